"""``build_plan``: the elastic pipeline planner (the paper's sequence processor), end to end.

1. chunking (:mod:`chunking`) for every candidate slice count ``K``: slice budget
   ``T_t = work(longest sequence) / K``, token cap ``T_m`` from memory (:func:`token_cap`); each
   candidate is scored by its slowest stage's compute plus the grouping overhead (bubbles and
   estimated recompute);
2. grouping (:mod:`grouping`) into consecutive 1F1B pipelines. Two finalists: the best candidate
   allowing recompute, and the best that needs none (halving ``T_m`` until one fits); the
   simulator picks between them;
3. recompute (:mod:`.recompute`) per pipeline on the exact memory walk (:mod:`memory`);
   if no finalist fits even fully checkpointed, ``T_m`` is halved and the search redone;
4. simulation (:mod:`simulator`) for the predicted numbers in ``Plan.stats``.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from megatron_epp.plan import Chunk, Pipeline, Plan, PlanInfeasible, PlanStats
from megatron_epp.planner.config import Recompute
from megatron_epp.planner.recompute import MemoryInfeasible, solve_recompute
from megatron_epp.planner.chunking import Units, build_units
from megatron_epp.cost.features import chunk_features, sequence_features
from megatron_epp.cost.model import CostModel
from megatron_epp.planner.grouping import group_units
from megatron_epp.simulator.memory import pipeline_memory
from megatron_epp.cost.profiles import GIB
from megatron_epp.simulator.step import SimResult, simulate

SLICE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
MIN_CHUNK_TOKENS = 64  # below this the token cap is not worth halving further: the batch does not fit


def token_cap(cost_model: CostModel, budget: float) -> int:
    """Largest chunk (one sequence) whose activations on stage 0, ``P`` chunks in flight without
    recompute, fit beside the model states: the default bucket token cap ``T_m``."""
    m, L0, P = cost_model.profile.memory, float(cost_model.layers[0]), cost_model.num_stages
    free = (budget - cost_model.model_state_bytes()[0]) / P
    if free <= 0:
        raise PlanInfeasible(f"model states alone need {cost_model.model_state_bytes()[0] / GIB:.1f} GB per GPU on stage 0")
    a, b = L0 * m.act_area, L0 * m.act_token
    t = free / b if a == 0 else (-b + np.sqrt(b * b + 4 * a * free)) / (2 * a)
    return max(int(t), 1)


def order_units(units: Units, w: np.ndarray) -> tuple[Units, np.ndarray]:
    """Units with more chunks first (ties: more work first), as the elastic 1F1B order wants; and
    the features of their chunks in that order. ``w``: the work vector."""
    feats = chunk_features([c for u in units for c in u])
    sizes = np.array([len(u) for u in units])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    order = np.lexsort((-np.add.reduceat(feats @ w, starts), -sizes))
    rows = np.concatenate([np.arange(starts[u], starts[u] + sizes[u]) for u in order])
    return [units[u] for u in order], feats[rows]


def make_plan(lengths: Sequence[int], cost_model: CostModel, groups: list[Units], builder: str) -> Plan:
    """Plan with the given pipelines (lists of units), chunk ids in execution order, no recompute."""
    pipes, next_id = [], 0
    for units in groups:
        chunks = [Chunk(next_id + i, c.kind, c.segments) for i, c in enumerate(c for u in units for c in u)]
        next_id += len(chunks)
        pipes.append(Pipeline(chunks, [[0] * len(chunks) for _ in range(cost_model.num_stages)]))
    return Plan(list(map(int, lengths)), cost_model.num_stages, cost_model.layers.tolist(), pipes, builder)


def apply_recompute(plan: Plan, cost_model: CostModel, budget: float, mode: Recompute, time_limit: float, mip_rel_gap: float) -> dict:
    """Decide every pipeline's recompute in place; returns the solver's summary."""
    states = cost_model.model_state_bytes()
    gaps, methods, rc = [], set(), 0.0
    for pipe in plan.pipelines:
        costs = cost_model.costs(chunk_features(pipe.chunks))
        res = solve_recompute(pipeline_memory(pipe, costs, cost_model.layers, states), costs.rc_layer, cost_model.layers, budget, mode, time_limit, mip_rel_gap)
        pipe.recompute = res.recompute
        gaps.append(res.gap)
        methods.add(res.method)
        rc += res.recompute_ms
    return {"mip_gap": float(max(gaps)), "recompute_method": "+".join(sorted(methods)), "program_recompute_ms": rc}


def predicted_times(plan: Plan, cost_model: CostModel, sim: SimResult) -> dict:
    """The time fields of :class:`PlanStats` for ``plan`` simulated on ``cost_model`` (``sim``), with
    the calibration they were predicted with."""
    overhead = cost_model.profile.overhead
    return dict(
        predicted_step_ms=sim.step_ms,
        bound_step_ms=cost_model.bound_ms(np.array(plan.seq_lengths)),
        bubble_ratio=sim.bubble_ratio,
        recompute_ms=sim.recompute_ms,
        speed_factor=cost_model.speed_factor,
        stage_overhead_ms=overhead.fwd_ms + overhead.bwd_ms,
    )


def finish(plan: Plan, cost_model: CostModel, budget: float, t0: float, extra: dict) -> Plan:
    """Validate, simulate and record the predicted numbers in ``plan.stats``; ``extra``: more
    :class:`PlanStats` fields (the builder's own)."""
    plan.validate()
    solve_ms = (time.perf_counter() - t0) * 1e3
    sim = simulate(plan, cost_model)
    plan.stats = PlanStats(
        **extra,
        **predicted_times(plan, cost_model, sim),
        solve_ms=solve_ms,
        peak_memory_gb=(sim.peak_memory / GIB).tolist(),
        memory_budget_gb=budget / GIB,
        fits=bool((sim.peak_memory <= budget * (1 + 1e-9)).all()),
        num_chunks=plan.chunk_counts(),
        num_pipelines=len(plan.pipelines),
        recomputed_layers=plan.recomputed_layers(),
    )
    return plan


def _candidate(lengths: np.ndarray, cost_model: CostModel, budget_t: float, cap: int, balance: bool, free: float, recompute: bool, cache: dict):
    """Chunk with one slice budget and group: ``(score, groups)``, score = slowest stage's compute
    plus the grouping overhead (infinite if no grouping fits). ``cache`` keeps the chunkings."""
    if (budget_t, cap) not in cache:
        w = cost_model.work_vector()
        units, feats = order_units(build_units(lengths, w, budget_t, cap, balance), w)
        cache[budget_t, cap] = units, cost_model.costs(feats)
    units, costs = cache[budget_t, cap]
    groups, overhead = group_units([len(u) for u in units], costs, cost_model.layers, free, recompute)
    return float((costs.fwd + costs.bwd).sum(axis=1).max()) + overhead, [units[a:b] for a, b in groups]


def _search(lengths: np.ndarray, cost_model: CostModel, cap: int, balance: bool, free: float, recompute: bool, slice_counts: Sequence[int], cache: dict):
    """Best candidate over the slice counts: ``(score, (slice budget, token cap), groups)``."""
    if balance:
        w = cost_model.work_vector()
        longest = float(sequence_features([lengths.max()])[0] @ w)
        budgets = [(longest / k, cap) for k in slice_counts]
    else:  # fixed-length chunks: search the length instead
        budgets = [(np.inf, t) for t in sorted({max(1, min(cap, int(lengths.max()) // k)) for k in slice_counts}, reverse=True)]
    best = (np.inf, budgets[0], None)
    worse = 0
    for t, m in budgets:  # scores are about unimodal in K: stop after two worse in a row
        score, groups = _candidate(lengths, cost_model, t, m, balance, free, recompute, cache)
        if score < best[0] or best[2] is None:
            best, worse = (score, (t, m), groups), 0
        else:
            worse += 1
            if worse == 2:
                break
    return best


def build_plan(
    lengths: Sequence[int],
    cost_model: CostModel,
    memory_gb: float,
    *,
    recompute: Recompute = "adaptive",
    balance: bool = True,
    slice_counts: Sequence[int] = SLICE_COUNTS,
    time_limit: float = 0.1,
    mip_rel_gap: float = 0.01,
    builder: str = "epp",
) -> Plan:
    """Elastic pipeline plan of one global batch (one data-parallel replica).

    ``memory_gb``: per GPU (GiB). ``recompute``: ``"adaptive"`` (the integer program), ``"greedy"``,
    ``"none"`` or ``"full"``. ``balance=False``: even slices and token-only packing into chunks of
    a searched fixed length (the "w/o workload balance" ablation).
    Raises :class:`PlanInfeasible` if nothing fits.
    """
    t0 = time.perf_counter()
    L = np.asarray(lengths, dtype=np.int64)
    if len(L) == 0 or (L < 1).any():
        raise PlanInfeasible("the batch must hold sequences of at least one token")
    budget = memory_gb * GIB
    cap = token_cap(cost_model, budget)
    if cap < MIN_CHUNK_TOKENS:
        raise PlanInfeasible(f"{memory_gb} GB per GPU leaves room for chunks of only {cap} tokens")
    free = budget - cost_model.model_state_bytes()[0]
    cache: dict = {}
    while cap >= MIN_CHUNK_TOKENS:
        finalists = []
        if recompute != "none":
            finalists.append(_search(L, cost_model, cap, balance, free, True, slice_counts, cache))
        if recompute != "full":  # the best plan that needs no recompute, with smaller chunks if need be
            for c in (cap, cap // 2, cap // 4):
                found = _search(L, cost_model, max(c, MIN_CHUNK_TOKENS), balance, free, False, slice_counts, cache)
                if np.isfinite(found[0]):
                    finalists.append(found)
                    break
            # The search's proxy score can prefer slices that the simulated step does not: the
            # packing-only candidate (one slice budget = the longest sequence) is always simulated too.
            packed = _search(L, cost_model, cap, balance, free, False, [1], cache) if balance else (np.inf, None, None)
            if np.isfinite(packed[0]) and all(packed[1] != f[1] for f in finalists):
                finalists.append(packed)
        plans = []
        for _, (slice_budget, cap_used), groups in finalists:
            plan = make_plan(L, cost_model, groups, builder)
            try:
                extra = apply_recompute(plan, cost_model, budget, recompute, time_limit, mip_rel_gap)
            except MemoryInfeasible:
                continue
            extra.update(slice_budget_ms=slice_budget, token_cap=cap_used)
            plans.append(finish(plan, cost_model, budget, t0, extra))
        if plans:
            return min(plans, key=lambda p: p.stats.predicted_step_ms)
        cap //= 2
    raise PlanInfeasible(f"no {recompute!r} plan fits {memory_gb} GB per GPU")
