"""What the stage is running now: the current chunk's layout, and the prefix K/V of split sequences.

The elastic schedule sets the current chunk (from the plan, on every stage) before each forward;
the attention and rotary modules read it. Prefix K/V are kept per (sequence, layer) as detached
leaves: later slices attend to them and accumulate their gradients, which the owning slice adds to
its own K/V gradient in its backward (see ``elastic_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_epp.plan import Chunk


@dataclass
class ChunkLayout:
    """Tensors derived once per chunk and shared by every layer of the stage."""

    chunk: Chunk
    position_ids: torch.Tensor  # [N] absolute positions
    split_seq: int | None  # the sequence whose slice this chunk holds (split/hybrid), else None
    split_tokens: tuple[int, int]  # that slice's [start, end) inside the packed chunk
    context: int  # tokens of earlier slices (C) the slice attends to
    keeps_kv: bool  # later slices of the sequence follow: keep this slice's K/V
    mask: torch.Tensor  # [N, C + N] bool, True = may attend; prefix keys first

    @classmethod
    def build(cls, chunk: Chunk, seq_lengths: list[int], device: torch.device) -> "ChunkLayout":
        bounds = chunk.cu_seqlens()
        split = next(
            (i for i, s in enumerate(chunk.segments) if s.length != seq_lengths[s.seq]), None
        )
        context = chunk.segments[split].start if split is not None else 0
        lengths = torch.tensor(chunk.lengths, device=device)
        seg = torch.repeat_interleave(torch.arange(len(chunk.segments), device=device), lengths)
        idx = torch.arange(chunk.num_tokens, device=device)
        own = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
        prefix = (seg == (split if split is not None else -1))[:, None].expand(-1, context)
        return cls(
            chunk=chunk,
            position_ids=torch.tensor(chunk.position_ids(), device=device),
            split_seq=chunk.segments[split].seq if split is not None else None,
            split_tokens=(bounds[split], bounds[split + 1]) if split is not None else (0, 0),
            context=context,
            keeps_kv=split is not None and chunk.segments[split].end < seq_lengths[chunk.segments[split].seq],
            mask=torch.cat([prefix, own], dim=1),
        )


@dataclass
class PrefixKV:
    """Detached K/V leaves of one sequence on one layer, keyed by slice start (idempotent writes)."""

    slices: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def prefix(self, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = sorted(s for s in self.slices if s < context)
        keys = [self.slices[s][0] for s in starts]
        values = [self.slices[s][1] for s in starts]
        got = sum(k.shape[0] for k in keys)
        if got != context:
            raise RuntimeError(f"prefix K/V holds {got} tokens, the slice needs {context}: slice order broken")
        return torch.cat(keys, 0), torch.cat(values, 0)


class ChunkState:
    """The stage's current chunk and its prefix K/V store."""

    def __init__(self) -> None:
        self.current: ChunkLayout | None = None
        self.kv: dict[tuple[int, int], PrefixKV] = {}

    def layout(self) -> ChunkLayout:
        if self.current is None:
            raise RuntimeError("no chunk is set: elastic layers run only inside forward_backward_elastic")
        return self.current

    def store(self, seq: int, layer: int) -> PrefixKV:
        return self.kv.setdefault((seq, layer), PrefixKV())

    def release(self, seq: int, layer: int) -> None:
        self.kv.pop((seq, layer), None)

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self.kv.values() for kv in e.slices.values() for t in kv)


CHUNK_STATE = ChunkState()
