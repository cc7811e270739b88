"""The plan builders behind one registry, :data:`BUILDERS` (``--epp-plan``), on the same cost model:

* ``elastic``: the EPP planner (:func:`~megatron_epp.planner.epp.build_plan`), which also weighs the
  plans below (Megatron packing, Seq1F1B with k = 2, 4, 8, 16 up to ``max_slices``) on the same cost model and budget and
  takes the fastest predicted: it never runs a plan slower than a baseline plan it could have made;
* ``megatron``: whole sequences packed into micro-batches of ``max_seq_len`` tokens (best-fit
  decreasing), one 1F1B pipeline, the same number of checkpointed layers for every micro-batch on
  every stage (Megatron's ``--recompute-num-layers``), the smallest that fits (notes section 6);
* ``seq1f1b``: sequences longer than ``max_seq_len / k`` cut into ``k`` slices of equal work, the
  rest (and the tails) packed into ``max_seq_len / k``-token chunks; one pipeline, uniform recompute.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Mapping, Sequence

import numpy as np

from megatron_epp.plan import Plan
from megatron_epp.planner.epp import SLICE_COUNTS, PlanInfeasible, build_plan, finish, make_plan, order_units
from megatron_epp.planner.chunking import build_units, equal_count_cuts
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.cost.features import chunk_features
from megatron_epp.cost.model import CostModel
from megatron_epp.simulator.memory import pipeline_memory
from megatron_epp.cost.profiles import GIB

SEQ1F1B_K = 4  # seq1f1b's slice count when the config sets no max_slices
SEQ1F1B_KS = (2, 4, 8, 16)  # Seq1F1B's fixed slice counts: the baseline reports its best, the elastic builder weighs each


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


def _uniform_plan(lengths: Sequence[int], cost_model: CostModel, budget_bytes: float, chunk_tokens: int, cuts, name: str,
                  validate: bool = True) -> Plan:
    t0 = time.perf_counter()
    L = np.asarray(lengths, dtype=np.int64)
    if L.max() > chunk_tokens and cuts is None:
        raise PlanInfeasible(f"a sequence of {L.max()} tokens exceeds the micro-batch of {chunk_tokens}")
    w = cost_model.work_vector()
    chunking, _ = order_units(build_units(L, w, np.inf, chunk_tokens, balance=False, cuts=cuts), w)
    plan = make_plan(L, cost_model, chunking, [(0, chunking.num_units)], name)
    uniform_recompute(plan, cost_model, budget_bytes)
    return finish(plan, cost_model, budget_bytes, t0, {}, validate)


def slice_counts(config: PlannerConfig) -> Sequence[int]:
    """The elastic planner's candidate slice counts: ``1 .. max_slices``, or its default ladder."""
    return SLICE_COUNTS if config.max_slices is None else range(1, config.max_slices + 1)


BaselinePlans = Mapping[str, Plan | None]  # baseline plans already made, by builder name (None: it does not fit)


def baseline_names(config: PlannerConfig) -> list[str]:
    """The baseline plans the elastic builder weighs, by builder name: ``megatron``, ``seq1f1b-k<k>`` for each k of
    :data:`SEQ1F1B_KS` up to ``max_slices``."""
    return ["megatron"] + [f"seq1f1b-k{k}" for k in SEQ1F1B_KS if k <= (config.max_slices or max(SEQ1F1B_KS))]


def baseline_plan(name: str, lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig,
                  known: BaselinePlans | None = None) -> Plan:
    """The baseline plan ``name`` (``megatron`` or ``seq1f1b-k<k>``), not validated; taken from ``known`` (plans of
    the same lengths, cost model and config made before) where it is there. Raises :class:`PlanInfeasible`."""
    if known is not None and name in known:
        if known[name] is None:
            raise PlanInfeasible(f"{name} does not fit")
        return known[name]
    if name == "megatron":
        return megatron_plan(lengths, cost_model, config, validate=False)
    return seq1f1b_plan(lengths, cost_model, replace(config, max_slices=int(name.removeprefix("seq1f1b-k"))), validate=False)


def baseline_candidates(lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig,
                        known: BaselinePlans | None = None) -> list[Plan]:
    """The baseline plans the elastic builder weighs (:func:`baseline_names`; not validated: :func:`elastic_plan`
    validates the one it chooses, those that do not fit left out; ``known``: as :func:`baseline_plan`). Their
    uniform recompute is one of the answers the adaptive/greedy programs search over, so only those
    modes weigh them (``none`` takes them only without recompute; ``full`` never)."""
    if config.recompute == "full":
        return []
    plans = []
    for name in baseline_names(config):
        try:
            plan = baseline_plan(name, lengths, cost_model, config, known)
        except PlanInfeasible:
            continue
        if config.recompute != "none" or plan.recomputed_layers() == 0:
            plans.append(plan)
    return plans


def elastic_plan(lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig,
                 known: BaselinePlans | None = None) -> Plan:
    """EPP's own plan, or a baseline plan where that is predicted faster (``stats.chosen``: which).
    ``known``: baseline plans made before (:func:`baseline_plan`); the one chosen is changed in place."""
    t0 = time.perf_counter()
    candidates, error = [], None
    try:
        candidates.append(build_plan(lengths, cost_model, config.memory_budget_bytes, recompute=config.recompute,
                                     slice_counts=slice_counts(config), time_limit=config.time_limit))
    except PlanInfeasible as infeasible:
        error = infeasible
    candidates += baseline_candidates(lengths, cost_model, config, known)
    if not candidates:
        raise error or PlanInfeasible(f"no plan fits {config.memory_budget_bytes / GIB} GB per GPU")
    best = min(candidates, key=lambda p: p.stats.predicted_step_ms)  # first wins ties: EPP's own plan
    if best.builder != "epp":
        best.validate()  # the baselines' plans are validated only when chosen (EPP's own always is)
    best.stats.chosen = best.builder
    best.stats.candidates_ms = {p.builder: round(p.stats.predicted_step_ms, 3) for p in candidates}
    best.stats.solve_ms = (time.perf_counter() - t0) * 1e3
    best.builder = "epp"
    return best


def megatron_plan(lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig, validate: bool = True) -> Plan:
    return _uniform_plan(lengths, cost_model, config.memory_budget_bytes, config.max_seq_len, None, "megatron", validate)


def seq1f1b_plan(lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig, validate: bool = True) -> Plan:
    k = SEQ1F1B_K if config.max_slices is None else config.max_slices
    max_seq_len = config.max_seq_len
    L = np.asarray(lengths, dtype=np.int64)
    slice_tokens = max(max_seq_len // k, 1)
    long = L > slice_tokens
    cuts = [np.array([0, n]) for n in L]
    for i, c in zip(np.flatnonzero(long), equal_count_cuts(L[long], k, cost_model.work_vector(), max_seq_len)):
        cuts[i] = c
    return _uniform_plan(L, cost_model, config.memory_budget_bytes, slice_tokens, cuts, f"seq1f1b-k{k}", validate)


Builder = Callable[[Sequence[int], CostModel, PlannerConfig], Plan]
BUILDERS: dict[str, Builder] = {"elastic": elastic_plan, "megatron": megatron_plan, "seq1f1b": seq1f1b_plan}


def plan_batch(lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig) -> Plan:
    """The plan of one global batch (one data-parallel replica) by ``config.builder``.
    Raises :class:`PlanInfeasible` if nothing fits."""
    return BUILDERS[config.builder](lengths, cost_model, config)
