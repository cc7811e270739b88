"""What the stage is running now: the current chunk's view, and the K/V buffers of split sequences.

One :class:`ChunkContext` per model, created by whoever builds the model: ``elastic_layer_spec(base,
context)`` hands it to the attention and the recompute layer (``ModuleSpec.params``),
``install_chunk_context(model, context)`` to RoPE and to the model (``model.elastic_context``), where
the schedule, the forward step and the memory tracker's owner find it (:meth:`ChunkContext.of`).
The elastic schedule sets the current chunk (from the plan, on every stage) around each forward and
backward (:meth:`ChunkContext.running`); the attention and rotary modules read it. A step that raises
leaves nothing behind (:meth:`ChunkContext.step`). A split sequence has one :class:`KVBuffer` per layer,
allocated for the whole sequence by its first slice: every slice writes its own K/V into it in place
and reads its prefix and its own K/V from it in place; later slices accumulate there the gradients of
earlier slices' K/V, which each slice adds to its own in its backward (see ``elastic_attention``).

What the attention kernels need from a chunk (explicit masks, the varlen kernels' ``cu_seqlens``) is built
once per chunk, on first use, and shared by all the stage's layers; RoPE's cos/sin tables once per forward
and once per backward of a chunk (``ChunkView.per_pass``), dropped when the pass ends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Hashable, Iterator

import numpy as np
import torch
from megatron.core.utils import get_attr_wrapped_model

from megatron_epp.executor.kv_host import KVHost
from megatron_epp.executor.offload import ActivationOffload
from megatron_epp.plan import Chunk


def bottom_right_causal_mask(s: int, context: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[s, context + s]`` bool: query ``i`` sees the ``context`` prefix keys and its own keys ``<= i``."""
    return torch.ones(s, context + s, dtype=torch.bool, device=device).tril(diagonal=context)


@dataclass(frozen=True)
class VarlenSeqlens:
    """Varlen metadata of a chunk (flash-attn, torch's ``varlen_attn``): one (query, key) sequence pair per segment.

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
class ChunkView:
    """What every layer of the stage needs to know about the current chunk (built once per chunk).

    The kernels' inputs (``masks``, ``varlen``) are built on first use, once per
    chunk: a backend reads only what it needs (flash-attn needs no mask, which on long slices would
    be ``s x (C + s)`` bytes per chunk of the pipeline).
    """

    chunk: Chunk
    position_ids: torch.Tensor  # [N] absolute positions
    bounds: list[tuple[int, int]]  # each segment's [start, end) in the packed chunk
    split_index: int | None  # the segment that is a slice of a longer sequence (split/hybrid), else None
    context: int  # tokens of earlier slices (C) that slice attends to
    seq_length: int  # the whole length of the sequence that slice belongs to: its K/V buffer's rows (0: no slice)
    device: torch.device
    recompute: int = 0  # layers of this stage that recompute this chunk (the stage's first ones)
    offload: int = 0  # of those, the first ones whose checkpoint (layer input) waits in host memory (executor.offload)
    max_position: int = 0  # the largest of position_ids, known on the host (RoPE's table length without a sync)
    padding: int = 0  # tokens after the chunk's own, a segment of their own (sequence or context parallelism: see ``build``)
    cp_rank: int = 0  # context parallelism: this rank's index in its group; it holds the chunk's tokens ``local_range``
    cp_size: int = 1
    kv_blocks: tuple[tuple[int, int], ...] = ()  # the split sequence's slices [start, end), in order (() : not known)
    kv_host: bool = False  # the split sequence's K/V buffer is in host memory (the plan's kv_host; executor.kv_host)
    # built on first use within one forward or backward of the chunk and dropped when it ends (``ChunkContext.running``)
    transient: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def per_pass(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()``, once per forward or backward of this chunk (kept in :attr:`transient` under ``key`` until
        ``ChunkContext.running`` ends): what every layer of the stage shares within a pass but need not be kept
        between the chunk's forward and its backward (RoPE's cos/sin tables, see ``executor.rotary``)."""
        value = self.transient.get(key)
        if value is None:
            value = self.transient[key] = build()
        return value

    @property
    def num_tokens(self) -> int:
        """The chunk's tokens as the layers see them: its own plus the padding."""
        return self.chunk.num_tokens + self.padding

    @property
    def local_tokens(self) -> int:
        """The tokens this context-parallel rank holds outside attention: ``num_tokens / cp_size``."""
        return self.num_tokens // self.cp_size

    @property
    def local_range(self) -> tuple[int, int]:
        """``[start, end)`` of this context-parallel rank's tokens in the (padded) chunk: the ``cp_rank``-th of
        ``cp_size`` equal blocks (the whole chunk without context parallelism)."""
        start = self.cp_rank * self.local_tokens
        return start, start + self.local_tokens

    @cached_property
    def local_position_ids(self) -> torch.Tensor:
        """``[local_tokens]``: the absolute positions of this rank's own tokens (its embeddings' and RoPE's), under
        context parallelism in a storage of their own (learned position embeddings save them: a view would keep the
        whole chunk's)."""
        start, end = self.local_range
        return self.position_ids[start:end].clone() if self.cp_size > 1 else self.position_ids

    @property
    def split_seq(self) -> int | None:
        return None if self.split_index is None else self.chunk.segments[self.split_index].seq

    @property
    def prefix_blocks(self) -> tuple[tuple[int, int], ...]:
        """The slice's prefix ``[0, context)`` as the blocks its attention runs over: the sequence's earlier slices
        (where the view knows them, ``kv_blocks``), else one block."""
        blocks = tuple(b for b in self.kv_blocks if b[1] <= self.context)
        if not blocks or blocks[-1][1] != self.context:
            return ((0, self.context),) if self.context else ()
        return blocks

    @cached_property
    def masks(self) -> list[torch.Tensor]:
        """Per segment ``[s, C + s]`` bottom-right causal (``C > 0`` only for the slice): the SDPA-masked path."""
        return [
            bottom_right_causal_mask(end - start, self.context if i == self.split_index else 0, self.device)
            for i, (start, end) in enumerate(self.bounds)
        ]

    @cached_property
    def varlen(self) -> VarlenSeqlens:
        """``cu_seqlens_q``/``cu_seqlens_k`` and max lengths for one varlen kernel call (flash-attn's or torch's)."""
        return varlen_seqlens(self.bounds, self.split_index, self.context, self.device)

    @classmethod
    def build(cls, chunk: Chunk, seq_lengths: list[int], device: torch.device, recompute: int = 0, multiple: int = 1,
              cp_rank: int = 0, cp_size: int = 1, offload: int = 0, slices: dict[int, tuple[tuple[int, int], ...]] | None = None,
              kv_host: frozenset[int] | set[int] = frozenset()) -> "ChunkView":
        """The view of ``chunk`` from the plan alone (host work: no device sync; on CUDA the
        positions go from pinned memory without blocking).

        ``multiple``: the token count the layers see must be a multiple of it (the tensor-parallel size under
        sequence parallelism, which splits every chunk's tokens evenly over the tensor-parallel ranks). The chunk
        is then padded at its end with ``padding_tokens(n, multiple)`` tokens as a segment of their own (positions
        from 0): they attend only to each other and come after every real token, so no real token attends to them;
        their loss mask is 0 (``chunk_batches``), so they change neither the loss nor any gradient. Under context
        parallelism (``cp_size`` ranks, ``multiple`` a multiple of it: :func:`token_multiple`) rank ``cp_rank`` holds
        the ``cp_rank``-th of ``cp_size`` equal blocks of the padded chunk (``local_range``); the view's segments,
        positions and prefix stay the whole chunk's, which its attention sees after the all-to-all. ``slices``: the
        pipeline's split sequences' slices (:func:`sequence_slices`), the blocks of a slice's prefix; ``kv_host``: the
        sequences whose K/V buffer is on the host."""
        if multiple % cp_size or not 0 <= cp_rank < cp_size:
            raise ValueError(f"context parallelism: rank {cp_rank} of {cp_size} with chunks padded to a multiple of {multiple}")
        cu = chunk.cu_seqlens()
        padding = padding_tokens(cu[-1], multiple)
        split = next((i for i, s in enumerate(chunk.segments) if s.length != seq_lengths[s.seq]), None)
        segment = chunk.segments[split] if split is not None else None
        positions = np.concatenate([np.arange(s.start, s.end, dtype=np.int64) for s in chunk.segments] + [np.arange(padding)])
        bounds = list(zip(cu[:-1], cu[1:])) + ([(cu[-1], cu[-1] + padding)] if padding else [])
        return cls(
            chunk=chunk,
            position_ids=to_device(torch.from_numpy(positions), device),
            bounds=bounds,
            split_index=split,
            context=segment.start if segment is not None else 0,
            seq_length=seq_lengths[segment.seq] if segment is not None else 0,
            device=torch.device(device),
            recompute=recompute,
            offload=offload,
            max_position=max(max(s.end for s in chunk.segments), padding) - 1,
            padding=padding,
            cp_rank=cp_rank,
            cp_size=cp_size,
            kv_blocks=(slices or {}).get(segment.seq, ()) if segment is not None else (),
            kv_host=segment is not None and segment.seq in kv_host,
        )


def sequence_slices(chunks: list[Chunk], seq_lengths: list[int]) -> dict[int, tuple[tuple[int, int], ...]]:
    """``{sequence: its slices' [start, end) in order}`` for the split sequences of ``chunks`` (a pipeline's)."""
    slices: dict[int, list[tuple[int, int]]] = {}
    for chunk in chunks:
        for s in chunk.segments:
            if s.length != seq_lengths[s.seq]:
                slices.setdefault(s.seq, []).append((s.start, s.end))
    return {seq: tuple(sorted(bounds)) for seq, bounds in slices.items()}


def padding_tokens(tokens: int, multiple: int) -> int:
    """Tokens to add to a chunk of ``tokens`` to make it a multiple of ``multiple``."""
    return -tokens % multiple


def token_multiple(config) -> int:
    """What every chunk's token count must be a multiple of for a model of ``config`` (a ``TransformerConfig``):
    the context-parallel size (each CP rank holds an equal block of the chunk), times the tensor-parallel size under
    sequence parallelism (each TP rank an equal share of its CP rank's block). A rank holds ``tokens / multiple``
    of a chunk between layers: what a stage sends."""
    return (config.tensor_model_parallel_size if config.sequence_parallel else 1) * config.context_parallel_size


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: on CUDA copied from pinned memory without blocking the
    host (the copy is ordered on the stream before any kernel that reads it); elsewhere as is."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _alias(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows ``[0, rows)`` of ``tensor`` as a tensor of its own: its storage, but not a view of it, so
    with an autograd version counter of its own."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), (rows, *tensor.shape[1:]), tensor.stride())


class KVBuffer:
    """K and V of one split sequence on one layer, ``[seq_length, b, kv_heads, head_dim]`` each in the
    activations' dtype and device, written slice by slice in place; and the gradient later slices
    accumulate for the rows of earlier slices.

    Rows ``[0, written)`` hold K/V. The slice with context ``C`` writes rows ``[C, C + s)`` once (a
    recomputed slice finds them written and leaves them: the first write wins) and its attention reads
    rows ``[0, C + s)``: its prefix, then its own K/V, no copy.

    Version counters: a slice's attention saves the rows it read for its backward, and later slices
    then write the rows after them. Autograd checks in-place writes per tensor (a view shares its
    base's counter), not per row, so every read is an alias with a counter of its own (``_alias``:
    ``Tensor.set_`` on the buffer's storage) and the buffer tensors themselves are only written, never
    saved. Nothing saved is ever modified: writes start at ``written``, past every row read so far.
    Unlike ``torch.autograd._unsafe_preserve_version_counter`` around the writes, this exempts only the
    buffer's own writes: an in-place change of a read alias is still caught.
    """

    def __init__(self, length: int, like: torch.Tensor, on_allocate: Callable[[], None] | None = None) -> None:
        self.key = torch.empty((length, *like.shape[1:]), dtype=like.dtype, device=like.device)
        self.value = torch.empty_like(self.key)
        self.written = 0
        self.grads: list[torch.Tensor | None] = [None, None]  # K, V: later slices' gradients of earlier rows
        self._on_allocate = on_allocate  # told when the gradient accumulators are allocated (memory tracking)

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Rows ``[start, start + s)`` of K and V, unless a first write already filled them."""
        end = start + key.shape[0]
        if end <= self.written:
            return
        if start != self.written:
            raise RuntimeError(f"K/V buffer holds {self.written} tokens, the slice starts at {start}: slice order broken")
        with torch.no_grad():  # the buffer belongs to no graph: the slices' _SliceKV carries the gradients
            self.key[start:end].copy_(key)
            self.value[start:end].copy_(value)
        self.written = end

    def read(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[0, rows)`` of K and V, in place (aliases: see the class docstring)."""
        return _alias(self.key, rows), _alias(self.value, rows)

    def gradients(self, start: int, grad_key: torch.Tensor, grad_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V gradients of the slice at ``start``, from those of the rows it read ``[0, start + s)``:
        its own rows' plus what later slices accumulated for them. Its prefix rows' are accumulated
        for the earlier slices (in a buffer of all rows, zeroed by the first slice to add, so that
        only the order of slices, not their lengths, decides what each receives)."""
        own = []
        for i, grad in enumerate((grad_key, grad_value)):
            mine = grad[start:]
            if self.grads[i] is not None:
                mine = mine + self.grads[i][start : start + mine.shape[0]]
            if start:
                if self.grads[i] is None:
                    self.grads[i] = torch.zeros_like(self.key)
                    if self._on_allocate is not None:
                        self._on_allocate()
                self.grads[i][:start] += grad[:start]
            own.append(mine)
        return own[0], own[1]


class ChunkContext:
    """A model's current chunk and its split sequences' K/V buffers, owned by the executor.

    Every elastic layer of the model holds the same context (given to them by the layer spec); the
    schedule reaches it through the model (:meth:`of`). Tests inject faults with a subclass.
    """

    ATTRIBUTE = "elastic_context"  # where install_chunk_context puts it on the model

    def __init__(self) -> None:
        self.current: ChunkView | None = None
        self.kv: dict[tuple[int, int], KVBuffer] = {}  # (sequence, layer number) -> its K/V buffer
        self.kv_version = 0  # changes whenever a K/V buffer or its accumulators are allocated, or released (memory tracking caches on it)
        self.attention_backends: dict = {}  # the attention kernel decided per (request, device type, dtype, dropout or not, GQA or not): once per model
        self.recomputing = False  # a recomputing layer's forward is under way (inside a backward): what an error was in
        self.offload: ActivationOffload | None = None  # made by the first chunk that offloads checkpoints (offloader)
        self.host_kv: KVHost | None = None  # the K/V buffers on the host (kv_host_store: made by the first slice of one)
        self.tracker = None  # the CPU activation memory tracker while one measures: it counts checkpoints offload keeps
        # test-only: called with "F" / "B" before each forward / backward of a chunk, "R" before each recomputing
        # layer's forward and "T" before each send/receive (the training driver's EPP_FAULT_INJECT plants an
        # out-of-memory error with it)
        self.fault_hook: Callable[[str, ChunkView], None] | None = None

    def before_op(self, kind: str, view: ChunkView) -> None:
        """``kind`` ("F", "B", "R": a layer's recompute, "T": a transfer) of the chunk of ``view`` is about to run."""
        if self.fault_hook is not None:
            self.fault_hook(kind, view)

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

    def view(self) -> ChunkView:
        if self.current is None:
            raise RuntimeError("no chunk is set: elastic layers run only inside forward_backward_elastic")
        return self.current

    @contextlib.contextmanager
    def running(self, view: ChunkView) -> Iterator[ChunkView]:
        """Make ``view`` the current chunk for one forward or backward; the previous one after."""
        previous, self.current = self.current, view
        try:
            yield view
        finally:
            self.current = previous
            view.transient.clear()

    @contextlib.contextmanager
    def step(self) -> Iterator["ChunkContext"]:
        """One schedule step: on any exception, forget the current chunk and release every K/V buffer."""
        try:
            yield self
        except BaseException:
            self.clear()
            raise

    def offloader(self, device: torch.device) -> ActivationOffload:
        """The model's :class:`ActivationOffload` (made on first use, on ``device``)."""
        if self.offload is None:
            self.offload = ActivationOffload(device, self._track)
        return self.offload

    def kv_host_store(self, device: torch.device) -> KVHost:
        """The model's :class:`~megatron_epp.executor.kv_host.KVHost` (made on first use, on ``device``'s offload)."""
        if self.host_kv is None:
            self.host_kv = KVHost(self.offloader(device), self._changed)
        return self.host_kv

    def _track(self, tensor: torch.Tensor):
        """The tracker's handle counting ``tensor`` on the device while a CPU tracker measures (else None)."""
        return None if self.tracker is None else self.tracker._pack(tensor)

    def kv_buffer(self, seq: int, layer: int, length: int, like: torch.Tensor) -> KVBuffer:
        """The K/V buffer of ``seq`` on ``layer``: ``length`` rows shaped (past the first dimension),
        typed and placed like ``like``; allocated by the first call, the sequence's first slice."""
        buffer = self.kv.get((seq, layer))
        if buffer is None:
            buffer = self.kv[seq, layer] = KVBuffer(length, like, self._changed)
            self._changed()
        return buffer

    def _changed(self) -> None:
        self.kv_version += 1

    def release(self, seq: int, layer: int) -> None:
        if self.kv.pop((seq, layer), None) is not None:
            self._changed()

    def kv_storages(self) -> dict[int, int]:
        """``{storage pointer: bytes}`` of the K/V buffers (what the slices' attention reads and saves).
        Their gradient accumulators are gradients, not activations: :meth:`kv_gradient_bytes`."""
        storages = [t.untyped_storage() for buffer in self.kv.values() for t in (buffer.key, buffer.value)]
        if self.host_kv is not None:  # the device windows of K/V buffers on the host
            storages += self.host_kv.storages()
        return {st.data_ptr(): st.nbytes() for st in storages}

    def kv_gradient_bytes(self) -> int:
        """Bytes of the K/V buffers' gradient accumulators allocated now."""
        windows = sum(st.nbytes() for st in self.host_kv.storages(grads=True)) if self.host_kv is not None else 0
        return windows + sum(g.untyped_storage().nbytes() for buffer in self.kv.values() for g in buffer.grads if g is not None)

    def clear(self) -> None:
        """Forget the current chunk and every K/V buffer (between independent runs)."""
        self.current = None
        self.kv.clear()
        if self.host_kv is not None:
            self.host_kv.clear()
        self._changed()

