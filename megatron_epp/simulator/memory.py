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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import sparse

from megatron_epp.plan import Pipeline
from megatron_epp.cost.model import ChunkCosts
from megatron_epp.plan.order import Op, sequence_units, stage_ops


@dataclass
class StageMemory:
    """Memory of one stage at each row (moment) of one pipeline's ops (bytes)."""

    ops: list[Op]
    base: np.ndarray  # (m,) memory at row r with no recompute
    live: sparse.csr_array  # (m, n) multiplier of chunk k's per-layer saving at row r (1: resident); sparse: few chunks are in flight at once
    saving: np.ndarray  # (n,) bytes freed per checkpointed layer of chunk k
    bwd_rows: np.ndarray  # rows of the backwards (memory peaks: nothing is freed before them)
    row_op: np.ndarray  # (m,) the op of each row

    def rows(self, recompute: np.ndarray) -> np.ndarray:
        """Memory at every row given the stage's recompute counts per chunk."""
        return self.base - self.live @ (self.saving * np.asarray(recompute, dtype=float))

    def during(self, recompute: np.ndarray) -> np.ndarray:
        """Peak memory during every op given the stage's recompute counts per chunk."""
        out = np.full(len(self.ops), -np.inf)
        np.maximum.at(out, self.row_op, self.rows(recompute))
        return out


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
    act = costs.act_layer - costs.lone_layer * is_slice
    head = costs.logits if stage == num_stages - 1 else np.zeros(n)
    embed = costs.embed if stage == 0 else np.zeros(n)
    resident = layers * (act + buffer) + head + embed
    saving = np.maximum(act - costs.ckpt_layer, 1e-9)
    # split sequences' (first slice, last slice, accumulator bytes per layer), where they are counted
    grads = [(u[0], u[-1], costs.kv_grad * buffer[u[0]]) for u in sequence_units(pipe) if len(u) > 1] if costs.kv_grad else []

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
    base[hi] += embed + act - costs.ckpt_layer + costs.rc_input - resident
    data[indptr[1:] - 1] = -(costs.ckpt_layer + buffer) / saving
    for first, last, grad in grads:
        # from the last slice's recompute row, (L - c) layers' accumulators, to the first slice's, c layers'
        base[hi[last] : hi[first]] += layers * grad
        data[indptr[last + 1] - 1] += grad / saving[last]
        data[indptr[first + 1] - 1] -= grad / saving[first]
        # the last slice's third row (its chunk's column ends at the second: what it holds is in the base)
        base[hi[last] + 1] += embed[last] + act[last] - costs.ckpt_layer[last] + costs.rc_input[last] + min(0.0, costs.ckpt_layer[last] - grad)
    live = sparse.csc_array((data, indices, indptr), shape=(m, n)).tocsr()
    return StageMemory(ops, base, live, saving, bwd_rows, row_op)


def pipeline_memory(pipe: Pipeline, costs: ChunkCosts, layers: np.ndarray, state_bytes: np.ndarray) -> list[StageMemory]:
    """:func:`stage_memory` of every stage."""
    P = len(layers)
    return [stage_memory(pipe, p, P, costs, int(layers[p]), float(state_bytes[p])) for p in range(P)]


def peak_memory(pipe: Pipeline, costs: ChunkCosts, layers: np.ndarray, state_bytes: np.ndarray) -> np.ndarray:
    """Peak bytes of every stage over the pipeline, with the pipeline's own recompute decisions."""
    return np.array([sm.during(pipe.recompute[p]).max() for p, sm in enumerate(pipeline_memory(pipe, costs, layers, state_bytes))])
