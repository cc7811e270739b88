"""What the stage is running now: the current chunk's layout, and the prefix K/V of split sequences.

One :class:`ChunkContext` per model, created by whoever builds the model: ``elastic_layer_spec(base,
context)`` hands it to the attention and the recompute layer (``ModuleSpec.params``),
``install_chunk_context(model, context)`` to RoPE and to the model (``model.elastic_context``), where
the schedule, the forward step and the memory tracker's owner find it (:meth:`ChunkContext.of`).
The elastic schedule sets the current chunk (from the plan, on every stage) around each forward and
backward (:meth:`ChunkContext.running`); the attention and rotary modules read it. A step that raises
leaves nothing behind (:meth:`ChunkContext.step`). Prefix K/V are kept per (sequence, layer) as detached
leaves: later slices attend to them and accumulate their gradients, which the owning slice adds to
its own K/V gradient in its backward (see ``elastic_attention``).

What the attention kernels need from a chunk (explicit masks, flash-attn's ``cu_seqlens``) is built
once per chunk, on first use, and shared by all the stage's layers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator

import numpy as np
import torch
from megatron.core.utils import get_attr_wrapped_model

from megatron_epp.plan import Chunk


def bottom_right_causal_mask(s: int, context: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[s, context + s]`` bool: query ``i`` sees the ``context`` prefix keys and its own keys ``<= i``."""
    return torch.ones(s, context + s, dtype=torch.bool, device=device).tril(diagonal=context)


@dataclass(frozen=True)
class VarlenSeqlens:
    """flash-attn varlen metadata of a chunk: one (query, key) sequence pair per segment.

    The slice's keys are its prefix K/V followed by its own tokens, so its key length is ``C + s``;
    every other segment's keys are its own tokens.
    """

    cu_seqlens_q: torch.Tensor  # [segments + 1] int32, on the chunk's device
    cu_seqlens_k: torch.Tensor  # [segments + 1] int32, on the chunk's device
    max_seqlen_q: int
    max_seqlen_k: int


def varlen_seqlens(bounds: list[tuple[int, int]], split_index: int | None, context: int, device: torch.device | str) -> VarlenSeqlens:
    """``cu_seqlens_q``/``cu_seqlens_k`` of segments ``bounds`` where segment ``split_index`` has ``context`` prefix keys."""
    q_lengths = [end - start for start, end in bounds]
    k_lengths = [s + (context if i == split_index else 0) for i, s in enumerate(q_lengths)]
    cu_q, cu_k = [0], [0]
    for sq, sk in zip(q_lengths, k_lengths):
        cu_q.append(cu_q[-1] + sq)
        cu_k.append(cu_k[-1] + sk)
    return VarlenSeqlens(
        cu_seqlens_q=to_device(torch.tensor(cu_q, dtype=torch.int32), device),
        cu_seqlens_k=to_device(torch.tensor(cu_k, dtype=torch.int32), device),
        max_seqlen_q=max(q_lengths),
        max_seqlen_k=max(k_lengths),
    )


@dataclass
class ChunkLayout:
    """What every layer of the stage needs to know about the current chunk (built once per chunk).

    The kernels' inputs (``masks``, ``slice_mask``, ``varlen``) are built on first use, once per
    chunk: a backend reads only what it needs (flash-attn needs no mask, which on long slices would
    be ``s x (C + s)`` bytes per chunk of the pipeline).
    """

    chunk: Chunk
    position_ids: torch.Tensor  # [N] absolute positions
    bounds: list[tuple[int, int]]  # each segment's [start, end) in the packed chunk
    split_index: int | None  # the segment that is a slice of a longer sequence (split/hybrid), else None
    context: int  # tokens of earlier slices (C) that slice attends to
    keeps_kv: bool  # later slices of the sequence follow: keep this slice's K/V
    device: torch.device
    recompute: int = 0  # layers of this stage that recompute this chunk (the stage's first ones)
    max_position: int = 0  # the largest of position_ids, known on the host (RoPE's table length without a sync)

    @property
    def split_seq(self) -> int | None:
        return None if self.split_index is None else self.chunk.segments[self.split_index].seq

    @cached_property
    def masks(self) -> list[torch.Tensor]:
        """Per segment ``[s, C + s]`` bottom-right causal (``C > 0`` only for the slice): the SDPA-masked path."""
        return [
            bottom_right_causal_mask(end - start, self.context if i == self.split_index else 0, self.device)
            for i, (start, end) in enumerate(self.bounds)
        ]

    @cached_property
    def slice_mask(self) -> torch.Tensor | None:
        """The slice's ``[s, C + s]`` bottom-right causal mask (None without a slice with context)."""
        if self.split_index is None or not self.context:
            return None
        start, end = self.bounds[self.split_index]
        return bottom_right_causal_mask(end - start, self.context, self.device)

    @cached_property
    def varlen(self) -> VarlenSeqlens:
        """``cu_seqlens_q``/``cu_seqlens_k`` and max lengths for one ``flash_attn_varlen_func`` call."""
        return varlen_seqlens(self.bounds, self.split_index, self.context, self.device)

    @classmethod
    def build(cls, chunk: Chunk, seq_lengths: list[int], device: torch.device, recompute: int = 0) -> "ChunkLayout":
        """The layout of ``chunk`` from the plan alone (host work: no device sync; on CUDA the
        positions go from pinned memory without blocking)."""
        cu = chunk.cu_seqlens()
        split = next((i for i, s in enumerate(chunk.segments) if s.length != seq_lengths[s.seq]), None)
        segment = chunk.segments[split] if split is not None else None
        positions = np.concatenate([np.arange(s.start, s.end, dtype=np.int64) for s in chunk.segments])
        return cls(
            chunk=chunk,
            position_ids=to_device(torch.from_numpy(positions), device),
            bounds=list(zip(cu[:-1], cu[1:])),
            split_index=split,
            context=segment.start if segment is not None else 0,
            keeps_kv=segment is not None and segment.end < seq_lengths[segment.seq],
            device=torch.device(device),
            recompute=recompute,
            max_position=max(s.end for s in chunk.segments) - 1,
        )


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: on CUDA copied from pinned memory without blocking the
    host (the copy is ordered on the stream before any kernel that reads it); elsewhere as is."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


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


class ChunkContext:
    """A model's current chunk and its prefix K/V store, owned by the executor.

    Every elastic layer of the model holds the same context (given to them by the layer spec); the
    schedule reaches it through the model (:meth:`of`). Tests inject faults with a subclass.
    """

    ATTRIBUTE = "elastic_context"  # where install_chunk_context puts it on the model

    def __init__(self) -> None:
        self.current: ChunkLayout | None = None
        self.kv: dict[tuple[int, int], PrefixKV] = {}
        self.kv_version = 0  # changes whenever K/V are kept or released (memory tracking caches on it)

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ChunkContext":
        """The context of ``model``, through DDP/Float16Module wrappers (megatron's ``get_attr_wrapped_model``)."""
        try:
            return get_attr_wrapped_model(model, cls.ATTRIBUTE)
        except RuntimeError:
            raise RuntimeError(
                "the model has no chunk context: build it with elastic_layer_spec(base, context) and "
                "install_chunk_context(model, context)"
            ) from None

    def layout(self) -> ChunkLayout:
        if self.current is None:
            raise RuntimeError("no chunk is set: elastic layers run only inside forward_backward_elastic")
        return self.current

    @contextlib.contextmanager
    def running(self, layout: ChunkLayout) -> Iterator[ChunkLayout]:
        """Make ``layout`` the current chunk for one forward or backward; the previous one after."""
        previous, self.current = self.current, layout
        try:
            yield layout
        finally:
            self.current = previous

    @contextlib.contextmanager
    def step(self) -> Iterator["ChunkContext"]:
        """One schedule step: on any exception, forget the current chunk and release every kept K/V."""
        try:
            yield self
        except BaseException:
            self.clear()
            raise

    def store(self, seq: int, layer: int) -> PrefixKV:
        return self.kv.setdefault((seq, layer), PrefixKV())

    def keep(self, seq: int, layer: int, start: int, kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the K/V leaves of the slice at ``start`` for later slices; the first write wins (a
        recompute gets the kept leaves back, so later slices' gradients keep accumulating on them)."""
        slices = self.store(seq, layer).slices
        if start not in slices:
            slices[start] = kv
            self.kv_version += 1
        return slices[start]

    def release(self, seq: int, layer: int) -> None:
        if self.kv.pop((seq, layer), None) is not None:
            self.kv_version += 1

    def kv_storages(self) -> dict[int, int]:
        """``{storage pointer: bytes}`` of the kept K/V (a slice's K and V share their QKV storage)."""
        storages = (t.untyped_storage() for e in self.kv.values() for kv in e.slices.values() for t in kv)
        return {st.data_ptr(): st.nbytes() for st in storages}

    def clear(self) -> None:
        """Forget the current chunk and every kept K/V (between independent runs)."""
        self.current = None
        self.kv.clear()
        self.kv_version += 1

