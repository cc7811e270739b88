"""Bottom of the library: plain values every stage shares (parallel sizes, units); imports nothing of megatron_epp, no torch."""
