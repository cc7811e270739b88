"""Exact memory walk of the elastic 1F1B order: every stage, every op, every chunk in flight.

During op ``j`` of a stage (its forward or its backward) the stage holds:

* its model states;
* the activations of every chunk whose forward has started and whose backward has not finished:
  per layer ``act`` bytes, or ``ckpt`` bytes (the layer input) if the layer is checkpointed; the last
  stage also holds the chunk's logits;
* the K/V of every slice of a split sequence except its last: kept from the slice's forward until
  the backward of the sequence's first slice (later slices attend to it; its gradient accumulates);
* during a backward, one layer's full activations as workspace (recomputed or gradient buffers).

So the memory during op ``j`` is ``base[j] - live[j] @ (saving * recompute)`` with ``recompute`` the
stage's checkpointed-layer counts: linear in the planner's decision variables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_epp.plan import Pipeline
from megatron_epp.planner.cost_model import ChunkCosts
from megatron_epp.schedule_order import Op, sequence_units, stage_ops


@dataclass
class StageMemory:
    """Memory of one stage during each op of one pipeline (bytes)."""

    ops: list[Op]
    base: np.ndarray  # (m,) memory during op j with no recompute
    live: np.ndarray  # (m, n) chunk k's activations are resident during op j
    saving: np.ndarray  # (n,) bytes freed per checkpointed layer of chunk k
    bwd_rows: np.ndarray  # op indices of the backwards (memory peaks: nothing is freed before them)

    def during(self, recompute: np.ndarray) -> np.ndarray:
        """Memory during every op given the stage's recompute counts per chunk."""
        return self.base - self.live @ (self.saving * np.asarray(recompute, dtype=float))


def retained_kv(pipe: Pipeline) -> tuple[np.ndarray, np.ndarray]:
    """``(retained, first)``: chunk keeps its K/V for later slices; position of its sequence's first slice."""
    n = len(pipe.chunks)
    retained = np.zeros(n, dtype=bool)
    first = np.arange(n)
    for unit in sequence_units(pipe):
        retained[unit[:-1]] = True
        first[unit] = unit[0]
    return retained, first


def stage_memory(pipe: Pipeline, stage: int, num_stages: int, costs: ChunkCosts, layers: int, state_bytes: float) -> StageMemory:
    """Walk ``stage_ops`` of one stage and tabulate what is resident during each op."""
    ops = stage_ops(pipe, stage, num_stages)
    n = len(pipe.chunks)
    fpos, bpos = np.empty(n, dtype=int), np.empty(n, dtype=int)
    for j, op in enumerate(ops):
        (fpos if op.kind == "F" else bpos)[op.pos] = j
    retained, first = retained_kv(pipe)
    j = np.arange(len(ops))[:, None]
    live = (j >= fpos) & (j <= bpos)
    kv_live = retained & (j >= fpos) & (j <= bpos[first])
    kv = costs.kv_layer * retained
    act = layers * (costs.act_layer - kv) + (costs.logits if stage == num_stages - 1 else 0.0)
    workspace = np.zeros(len(ops))
    workspace[bpos] = costs.act_layer
    base = state_bytes + live @ act + kv_live @ (layers * kv) + workspace
    saving = np.maximum(costs.act_layer - kv - costs.ckpt_layer, 0.0)
    return StageMemory(ops, base, live, saving, np.sort(bpos))


def pipeline_memory(pipe: Pipeline, costs: ChunkCosts, layers: np.ndarray, state_bytes: np.ndarray) -> list[StageMemory]:
    """:func:`stage_memory` of every stage."""
    P = len(layers)
    return [stage_memory(pipe, p, P, costs, int(layers[p]), float(state_bytes[p])) for p in range(P)]


def peak_memory(pipe: Pipeline, costs: ChunkCosts, layers: np.ndarray, state_bytes: np.ndarray) -> np.ndarray:
    """Peak bytes of every stage over the pipeline, with the pipeline's own recompute decisions."""
    return np.array([sm.during(pipe.recompute[p]).max() for p, sm in enumerate(pipeline_memory(pipe, costs, layers, state_bytes))])
