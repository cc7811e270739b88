"""RoPE at each token's absolute position: a slice starts at C, packed sequences restart at 0.

``GPTModel._preprocess`` asks its ``rotary_pos_emb`` for positions ``0..s-1``. The wrapper below
takes the frequencies up to the chunk's largest position (known on the host from the plan) and
gathers them at the current chunk's position ids, which is what RoPE with ``offset = C`` gives a slice and what restarting at 0 gives
packed sequences.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_epp.executor.context import ChunkContext


class ChunkRotaryEmbedding(torch.nn.Module):
    """Wraps megatron-core's ``RotaryEmbedding`` (no parameters of its own) at ``context``'s current chunk."""

    def __init__(self, inner: torch.nn.Module, context: ChunkContext) -> None:
        super().__init__()
        self.inner = inner
        self.context = context

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None) -> torch.Tensor:
        layout = self.context.layout()
        freqs = self.inner(layout.max_position + 1)  # the host knows the length: no device sync
        return freqs[layout.position_ids]
