"""Exact memory walk of the elastic 1F1B order: every stage, every op, every chunk in flight.

The stage holds its model states and, for every chunk whose forward has started and whose backward
has not finished, what that chunk's layers save for backward: per layer ``act`` bytes, or ``ckpt``
bytes (the layer input) if the layer is checkpointed; the first stage also the embedding's saved
ids, the last stage the output head's saved tensors (until the chunk's backward starts). A split
sequence has one K/V buffer per layer for all its tokens, allocated by its first slice's forward and
freed by that slice's backward, which is the sequence's last: it counts with the first slice
(``buffer``). Its slices' layers do not save their own K/V beside it: a chunk that is only a slice
saves ``lone_layer`` less. Where the allocator is measured (``kv_grad``) the sequence's K/V gradient
accumulators count too, ``kv_grad`` bytes per byte of its buffer per layer (``grad``): allocated, layer
by layer, by its first backward (its last slice's) and freed with the buffer, layer by layer, by its
first slice's backward.

Memory only grows during a forward and only shrinks during a backward, except where a checkpointed
layer recomputes. So each op gives the walk one, two or three *rows* (moments):

* ``F``: the end of the chunk's forward;
* ``B``: the start of the backward (plus ``workspace``: gradient buffers, counted where the
  allocator is measured; the recomputed layer's activations stand for them below), and the recompute of the chunk's last checkpointed layer, the first to
  run in backward: the layers after it have already freed what they saved (and the output head its
  tensors; a first slice its K/V buffers of those layers too), the earlier checkpointed layers still
  hold their inputs and the recomputed layer holds its full activations. With ``c`` checkpointed
  layers that is ``act - ckpt + c * (ckpt + buffer)``, growing with ``c`` (plus ``rc_input`` where the
  recomputed layer saves a copy of its kept input, not the input itself: RMSNorm on bf16).
  With gradient accumulators a first slice's checkpointed layers hold theirs there (``c * grad``),
  and a sequence's last slice, whose backward allocates them, ``(L - c) * grad``; its backward has a
  third row, the recompute of its first layer: ``act + (L - 1) * grad``, the larger one where ``grad >
  ckpt`` (counted as the least of the second row at ``c = 0`` and at ``c = 1``: never more than the
  truth, at any ``c``; at ``c = 0`` what the backward holds when it allocates its first layer's).

Memory at every row is ``base - live @ (saving * recompute)``, linear in the stage's
checkpointed-layer counts (the planner's decision variables): ``live[r, k]`` is 1 while chunk ``k``
is resident, and during ``k``'s own recompute row the (negative) multiple of ``saving[k]`` that
each checkpointed layer adds.

Activation offload (docs/planner.md, "Activation offload"). A chunk's ``o`` offloaded checkpoints (of its ``c``
checkpointed layers, the first ``o``) are on the host at every row the chunk is resident: the device holds ``o *
ckpt`` less there, the host ``o * ckpt`` more (``resident``: 1 at those rows), and at the chunk's own recompute row
offloaded inputs are back on the device (:func:`prefetch_slots`, the executor's order, ``executor/offload.py``): where
``o < c`` the next one below, fetched ahead while the kept layers recompute; at ``o = c`` the recomputed layer's own
and, where ``c >= 2``, the next one, fetched behind it. So the recompute row holds ``act - ckpt + (c - o) * ckpt +
slots * ckpt`` (measured to the byte on CPU: tests/integration/test_offload_executor.py). A split sequence whose K/V buffer is on the host (the pipeline's ``kv_host``) holds on the
device, from its first slice's forward to that slice's backward, only :data:`KV_WINDOW` blocks of its largest
slice's K/V of one layer (and as many of its gradient accumulators where those are counted): the block in use and
the one being fetched; the host holds every layer's buffer (and accumulators) over the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from scipy import sparse

from megatron_epp.plan import Pipeline
from megatron_epp.cost.model import ChunkCosts
from megatron_epp.plan.order import Op, sequence_units, stage_ops

KV_WINDOW = 2  # blocks of a slice's K/V of one layer on the device for a K/V buffer on the host: in use + in flight


@dataclass
class StageMemory:
    """Memory of one stage at each row (moment) of one pipeline's ops (bytes)."""

    ops: list[Op]
    base: np.ndarray  # (m,) memory at row r with no recompute
    live: sparse.csr_array  # (m, n) multiplier of chunk k's per-layer saving at row r (1: resident); sparse: few chunks are in flight at once
    saving: np.ndarray  # (n,) bytes freed per checkpointed layer of chunk k
    bwd_rows: np.ndarray  # rows of the backwards (memory peaks: nothing is freed before them)
    row_op: np.ndarray  # (m,) the op of each row
    # activation offload (module docstring); ``resident``, ``host_base`` and ``fwd_rows`` are built on first use from
    # ``spans`` (a plan without offload never reads them: the planner walks memory for every finalist)
    ckpt: np.ndarray  # (n,) one checkpointed layer's input: what an offloaded checkpoint moves to the host
    own_row: np.ndarray  # (n,) chunk k's recompute row (where an offloaded checkpoint's prefetch slot counts)
    spans: tuple[np.ndarray, np.ndarray, np.ndarray] = field(repr=False)  # live's (indices, indptr); host K/V bytes per chunk

    @cached_property
    def resident(self) -> sparse.csr_array:
        """(m, n) 1 while chunk k is resident (its forward's row to its recompute row)."""
        indices, indptr, _ = self.spans
        return sparse.csc_array((np.ones(indptr[-1]), indices, indptr), shape=self.live.shape).tocsr()

    @cached_property
    def host_base(self) -> np.ndarray:
        """(m,) host bytes at row r without offloaded checkpoints (K/V buffers on the host, while their chunk is resident)."""
        return self.resident @ self.spans[2]

    @cached_property
    def fwd_rows(self) -> np.ndarray:
        """Rows of the forwards (host peaks: nothing is added to the host at a backward)."""
        return np.setdiff1d(np.arange(len(self.base)), self.bwd_rows)

    def rows(self, recompute: np.ndarray, offload: np.ndarray | None = None) -> np.ndarray:
        """Memory at every row given the stage's recompute counts per chunk (and offloaded checkpoints per chunk)."""
        c = np.asarray(recompute, dtype=float)
        out = self.base - self.live @ (self.saving * c)
        if offload is not None and np.any(offload):
            o = np.asarray(offload, dtype=float)
            out = out - self.resident @ (self.ckpt * o)
            np.add.at(out, self.own_row, self.ckpt * prefetch_slots(c, o))
        return out

    def during(self, recompute: np.ndarray, offload: np.ndarray | None = None) -> np.ndarray:
        """Peak memory during every op given the stage's recompute (and offload) counts per chunk."""
        out = np.full(len(self.ops), -np.inf)
        np.maximum.at(out, self.row_op, self.rows(recompute, offload))
        return out

    def host_rows(self, offload: np.ndarray | None = None) -> np.ndarray:
        """Host bytes at every row given the offloaded checkpoints per chunk."""
        if offload is None or not np.any(offload):
            return self.host_base
        return self.host_base + self.resident @ (self.ckpt * np.asarray(offload, dtype=float))


def prefetch_slots(recompute: np.ndarray, offload: np.ndarray) -> np.ndarray:
    """Offloaded checkpoints back on the device at a chunk's first recompute (its last checkpointed layer's), per
    chunk: none without offload; one where ``0 < o < c`` (the next one below, fetched ahead) or ``o = c = 1`` (the
    recomputed layer's own); two where ``o = c >= 2`` (its own and the next one's)."""
    return (offload > 0).astype(float) + ((offload == recompute) & (recompute >= 2))


def kv_buffers(pipe: Pipeline, kv_layer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(is_slice, buffer)``: the chunk holds a slice of a split sequence; the bytes of the K/V buffer
    it allocates per layer (a first slice: its sequence's, the ``kv_layer`` of all its slices; else 0)."""
    n = len(pipe.chunks)
    is_slice, buffer = np.zeros(n, dtype=bool), np.zeros(n)
    for unit in sequence_units(pipe):
        if len(unit) > 1:
            is_slice[unit] = True
            buffer[unit[0]] = kv_layer[unit].sum()
    return is_slice, buffer


def kv_host_units(pipe: Pipeline) -> list[list[int]]:
    """The split sequences of ``pipe`` whose K/V buffer is on the host (``kv_host``), each as its chunks' positions."""
    host = set(pipe.kv_host)
    if not host:
        return []
    return [u for u in sequence_units(pipe) if len(u) > 1 and pipe.chunks[u[0]].segments[-1].seq in host]


def kv_host_bytes(units: list[list[int]], costs: ChunkCosts, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(window, per_layer)`` per chunk (at each host sequence's first slice, else 0): the device's K/V blocks of a
    buffer on the host (:data:`KV_WINDOW` of its largest slice's K/V of one layer, and as many accumulator blocks
    where those are counted), and the host's bytes per layer (its buffer and accumulators)."""
    window, per_layer = np.zeros(n), np.zeros(n)
    for u in units:
        window[u[0]] = KV_WINDOW * costs.kv_layer[u].max() * (1.0 + costs.kv_grad)
        per_layer[u[0]] = costs.kv_layer[u].sum() * (1.0 + costs.kv_grad)
    return window, per_layer


def stage_memory(pipe: Pipeline, stage: int, num_stages: int, costs: ChunkCosts, layers: int, state_bytes: float) -> StageMemory:
    """Walk ``stage_ops`` of one stage and tabulate what is resident at each row."""
    ops = stage_ops(pipe, stage, num_stages)
    n = len(pipe.chunks)
    fpos, bpos = np.empty(n, dtype=int), np.empty(n, dtype=int)
    is_bwd = np.array([op.kind == "B" for op in ops])
    pos = np.array([op.pos for op in ops])
    fpos[pos[~is_bwd]] = np.flatnonzero(~is_bwd)
    bpos[pos[is_bwd]] = np.flatnonzero(is_bwd)
    is_slice, buffer = kv_buffers(pipe, costs.kv_layer)
    host_units = kv_host_units(pipe)
    window, host_kv = kv_host_bytes(host_units, costs, n)
    on_host = {u[0] for u in host_units}
    buffer[list(on_host)] = 0.0  # a buffer on the host: its window instead (in the base, like the head's tensors)
    act = costs.act_layer - costs.lone_layer * is_slice
    head = costs.logits if stage == num_stages - 1 else np.zeros(n)
    embed = costs.embed if stage == 0 else np.zeros(n)
    resident = layers * (act + buffer) + head + embed + window
    saving = np.maximum(act - costs.ckpt_layer, 1e-9)
    # split sequences' (first slice, last slice, accumulator bytes per layer), where they are counted on the device
    grads = [(u[0], u[-1], costs.kv_grad * buffer[u[0]]) for u in sequence_units(pipe)
             if len(u) > 1 and u[0] not in on_host] if costs.kv_grad else []

    # rows: F -> end of forward; B -> start of backward, then its first recompute (a last slice's with
    # accumulators: then the recompute of its first layer)
    per_op = np.where(is_bwd, 2, 1)
    per_op[bpos[[last for _, last, _ in grads]]] = 3
    row_op = np.repeat(np.arange(len(ops)), per_op)
    first_row = np.concatenate([[0], np.cumsum(per_op)[:-1]])
    # chunk k is resident from the row of its forward to the last row (its recompute) of its backward
    lo, hi = first_row[fpos], first_row[bpos] + 1
    m = len(row_op)
    counts = hi - lo + 1
    indptr = np.concatenate([[0], np.cumsum(counts)])
    indices = np.repeat(lo - indptr[:-1], counts) + np.arange(indptr[-1])
    data = np.ones(indptr[-1])
    diff = np.zeros(m + 1)
    np.add.at(diff, lo, resident)
    np.add.at(diff, hi + 1, -resident)
    base = state_bytes + np.cumsum(diff)[:m]
    bwd_rows = np.flatnonzero(np.repeat(is_bwd, per_op))
    start_rows = first_row[bpos]
    base[start_rows] += costs.workspace
    # chunk k during the recompute of its last checkpointed layer: act - ckpt + c * (ckpt + buffer)
    # (+ rc_input where the recomputed layer's saved tensors do not share its kept input)
    base[hi] += embed + act - costs.ckpt_layer + costs.rc_input + window - resident
    data[indptr[1:] - 1] = -(costs.ckpt_layer + buffer) / saving
    for first, last, grad in grads:
        # from the last slice's recompute row, (L - c) layers' accumulators, to the first slice's, c layers'
        base[hi[last] : hi[first]] += layers * grad
        data[indptr[last + 1] - 1] += grad / saving[last]
        data[indptr[first + 1] - 1] -= grad / saving[first]
        # the last slice's third row (its chunk's column ends at the second: what it holds is in the base)
        base[hi[last] + 1] += embed[last] + act[last] - costs.ckpt_layer[last] + costs.rc_input[last] + min(0.0, costs.ckpt_layer[last] - grad)
    live = sparse.csc_array((data, indices, indptr), shape=(m, n)).tocsr()
    return StageMemory(ops, base, live, saving, bwd_rows, row_op, costs.ckpt_layer.astype(float), hi,
                       (indices, indptr, layers * host_kv))


def pipeline_memory(pipe: Pipeline, costs: ChunkCosts, layers: np.ndarray, state_bytes: np.ndarray) -> list[StageMemory]:
    """:func:`stage_memory` of every stage."""
    P = len(layers)
    return [stage_memory(pipe, p, P, costs, int(layers[p]), float(state_bytes[p])) for p in range(P)]


def peak_memory(pipe: Pipeline, costs: ChunkCosts, layers: np.ndarray, state_bytes: np.ndarray) -> np.ndarray:
    """Peak bytes of every stage over the pipeline, with the pipeline's own recompute (and offload) decisions."""
    return np.array([sm.during(pipe.recompute[p], pipe.offloaded(p) if pipe.offload else None).max()
                     for p, sm in enumerate(pipeline_memory(pipe, costs, layers, state_bytes))])


def peak_host_memory(pipe: Pipeline, costs: ChunkCosts, layers: np.ndarray) -> np.ndarray:
    """Peak host bytes of every stage's GPU over the pipeline (offloaded checkpoints, K/V buffers on the host)."""
    if not pipe.offload and not pipe.kv_host:
        return np.zeros(len(layers))
    zeros = np.zeros(len(layers))
    return np.array([sm.host_rows(pipe.offloaded(p) if pipe.offload else None).max(initial=0.0)
                     for p, sm in enumerate(pipeline_memory(pipe, costs, layers, zeros))])
