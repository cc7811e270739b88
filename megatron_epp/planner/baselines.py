"""Baseline planners on the same cost model and simulator (notes section 6).

* ``megatron``: whole sequences packed into micro-batches of ``max_seq_len`` tokens (best-fit
  decreasing), one 1F1B pipeline, the same number of checkpointed layers for every micro-batch on
  every stage (Megatron's ``--recompute-num-layers``), the smallest that fits;
* ``seq1f1b``: sequences longer than ``max_seq_len / k`` cut into ``k`` slices of equal work, the
  rest (and the tails) packed into ``max_seq_len / k``-token chunks; one pipeline, uniform recompute;
* ``epp-no-ckpt`` / ``epp-full-ckpt``: the EPP planner without / with full checkpointing;
* ``epp-no-balance``: even-length slices and token-only packing ("w/o workload balance");
* ``flexsp``: adaptive sequence parallelism (:mod:`flexsp`), simulated only.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from megatron_epp.plan import Plan
from megatron_epp.planner.builder import PlanInfeasible, build_plan, finish, make_plan, order_units
from megatron_epp.planner.chunking import build_units, equal_count_cuts
from megatron_epp.cost.model import CostModel, chunk_features
from megatron_epp.simulator.flexsp import plan_flexsp
from megatron_epp.simulator.memory import pipeline_memory
from megatron_epp.cost.profiles import GIB

BASELINES = ("megatron", "seq1f1b", "epp-no-ckpt", "epp-full-ckpt", "epp-no-balance", "flexsp")


def uniform_recompute(plan: Plan, cost_model: CostModel, budget: float) -> None:
    """Set the smallest uniform number of checkpointed layers per stage that fits, in place."""
    states = cost_model.model_state_bytes()
    mems = [pipeline_memory(p, cost_model.costs(chunk_features(p.chunks)), cost_model.layers, states) for p in plan.pipelines]
    for r in range(int(cost_model.layers.min()) + 1):
        if all(sm.during(np.full(len(sm.saving), r)).max() <= budget for pm in mems for sm in pm):
            for pipe in plan.pipelines:
                pipe.recompute = [[r] * len(pipe.chunks) for _ in range(plan.num_stages)]
            return
    raise PlanInfeasible(f"does not fit {budget / GIB:.0f} GB even with full recompute")


def _uniform_plan(lengths: Sequence[int], cost_model: CostModel, memory_gb: float, chunk_tokens: int, cuts, name: str) -> Plan:
    t0 = time.perf_counter()
    L = np.asarray(lengths, dtype=np.int64)
    if L.max() > chunk_tokens and cuts is None:
        raise PlanInfeasible(f"a sequence of {L.max()} tokens exceeds the micro-batch of {chunk_tokens}")
    w = cost_model.work_vector()
    units = build_units(L, w, np.inf, chunk_tokens, balance=False, cuts=cuts)
    units, _ = order_units(units, w)
    plan = make_plan(L, cost_model, [units], name)
    uniform_recompute(plan, cost_model, memory_gb * GIB)
    return finish(plan, cost_model, memory_gb * GIB, t0, {})


def megatron_plan(lengths: Sequence[int], cost_model: CostModel, memory_gb: float, max_seq_len: int) -> Plan:
    return _uniform_plan(lengths, cost_model, memory_gb, max_seq_len, None, "megatron")


def seq1f1b_plan(lengths: Sequence[int], cost_model: CostModel, memory_gb: float, max_seq_len: int, k: int = 4) -> Plan:
    L = np.asarray(lengths, dtype=np.int64)
    slice_tokens = max(max_seq_len // k, 1)
    long = L > slice_tokens
    cuts = [np.array([0, n]) for n in L]
    for i, c in zip(np.flatnonzero(long), equal_count_cuts(L[long], k, cost_model.work_vector(), max_seq_len)):
        cuts[i] = c
    return _uniform_plan(L, cost_model, memory_gb, slice_tokens, cuts, f"seq1f1b-k{k}")


def summarize(plan: Plan) -> dict[str, Any]:
    return {k: getattr(plan.stats, k) for k in ("predicted_step_ms", "peak_memory_gb", "bubble_ratio", "recompute_ms", "num_pipelines", "recomputed_layers", "num_chunks")}


def run_baselines(
    lengths: Sequence[int],
    cost_model: CostModel,
    memory_gb: float,
    max_seq_len: int,
    seq1f1b_k: int = 4,
    names: Sequence[str] = BASELINES,
) -> dict[str, dict[str, Any]]:
    """Predicted step time and peak memory of every baseline; ``{"fits": False, "reason": ...}`` if it cannot fit."""
    makers = {
        "megatron": lambda: summarize(megatron_plan(lengths, cost_model, memory_gb, max_seq_len)),
        "seq1f1b": lambda: summarize(seq1f1b_plan(lengths, cost_model, memory_gb, max_seq_len, seq1f1b_k)),
        "epp-no-ckpt": lambda: summarize(build_plan(lengths, cost_model, memory_gb, checkpointing="none", builder="epp-no-ckpt")),
        "epp-full-ckpt": lambda: summarize(build_plan(lengths, cost_model, memory_gb, checkpointing="full", builder="epp-full-ckpt")),
        "epp-no-balance": lambda: summarize(build_plan(lengths, cost_model, memory_gb, balance=False, builder="epp-no-balance")),
        "flexsp": lambda: plan_flexsp(lengths, cost_model, memory_gb),
    }
    out = {}
    for name in names:
        try:
            out[name] = {"fits": True, **makers[name]()}
        except PlanInfeasible as e:
            out[name] = {"fits": False, "reason": str(e)}
    return out
