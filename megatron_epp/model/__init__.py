"""Layer-spec pieces for elastic chunks: packed/prefix-K/V attention, position-indexed RoPE."""
