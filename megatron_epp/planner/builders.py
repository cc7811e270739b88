"""The plan builders, one typed record each (:class:`Builder`: its name, Seq1F1B's ``k``, its function), in one
registry, :data:`BUILDERS` (``--epp-plan``), on the same cost model. A builder's identity is the record
(:data:`ELASTIC`, :data:`MEGATRON`, :data:`SEQ1F1B`, ``SEQ1F1B.at(4)``), also in :class:`PlannerConfig`; strings only
where flags, logs and the Plan JSON name it (:attr:`Builder.name`, :attr:`Builder.plan_name`; ``--epp-plan``'s name
becomes its record in :meth:`PlannerConfig.from_options`). A builder gives a plan with its report
(:class:`~megatron_epp.plan.PlannedStep`):

* ``elastic``: the EPP planner (:func:`~megatron_epp.planner.epp.build_plan`), which also weighs the
  plans below (Megatron packing, Seq1F1B with k = 2, 4, 8, 16 up to ``max_slices``) on the same cost model and budget and
  takes the fastest predicted: it never runs a plan slower than a baseline plan it could have made;
* ``megatron``: whole sequences packed into micro-batches of ``max_seq_len`` tokens (best-fit
  decreasing), one 1F1B pipeline, the same number of checkpointed layers for every micro-batch on
  every stage (Megatron's ``--recompute-num-layers``), the smallest that fits (docs/baselines.md);
* ``seq1f1b``: sequences longer than ``max_seq_len / k`` cut into ``k`` slices of equal work, the
  rest (and the tails) packed into ``max_seq_len / k``-token chunks; one pipeline, uniform recompute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from megatron_epp.plan import Plan, PlannedStep, PlanReport
from megatron_epp.planner.epp import NO_OFFLOAD, SLICE_COUNTS, OffloadChoice, PlanInfeasible, build_plan, finish, make_plan, order_units
from megatron_epp.planner.chunking import build_units, equal_count_cuts
from megatron_epp.cost.features import chunk_features
from megatron_epp.cost.model import CostModel
from megatron_epp.simulator.memory import pipeline_memory
from megatron_epp.base.units import GIB

if TYPE_CHECKING:  # the config holds a builder record: it imports this module
    from megatron_epp.planner.config import PlannerConfig

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


def _uniform_plan(lengths: Sequence[int], cost_model: CostModel, budget_bytes: float, chunk_tokens: int, cuts, name: str) -> PlannedStep:
    t0 = time.perf_counter()
    L = np.asarray(lengths, dtype=np.int64)
    if L.max() > chunk_tokens and cuts is None:
        raise PlanInfeasible(f"a sequence of {L.max()} tokens exceeds the micro-batch of {chunk_tokens}")
    w = cost_model.work_vector()
    chunking, _ = order_units(build_units(L, w, np.inf, chunk_tokens, balance=False, cuts=cuts), w)
    plan = make_plan(L, cost_model, chunking, [(0, chunking.num_units)], name)
    uniform_recompute(plan, cost_model, budget_bytes)
    return finish(plan, cost_model, budget_bytes, t0)


def slice_counts(config: PlannerConfig) -> Sequence[int]:
    """The elastic planner's candidate slice counts: ``1 .. max_slices``, or its default ladder."""
    return SLICE_COUNTS if config.max_slices is None else range(1, config.max_slices + 1)


Build = Callable[[Sequence[int], CostModel, "PlannerConfig", "BaselinePlans | None"], PlannedStep]


@dataclass(frozen=True)
class Builder:
    """One plan builder, named two ways: :attr:`name`, as flags, logs and the benchmarks name it (``elastic``,
    ``megatron``, ``seq1f1b-k4``), and :attr:`plan_name`, as its plans are named (``Plan.builder``,
    ``PlanReport.chosen``: ``epp``, ``megatron``, ``seq1f1b-k4``). Its fields: ``flag``, its ``--epp-plan`` value;
    ``build`` (lengths, cost model, config and the baseline plans made before, :data:`BaselinePlans`, or None: a plan
    with its report, not validated); Seq1F1B's fixed slice count ``k`` (None: the config's ``max_slices``, else
    :data:`SEQ1F1B_K`; in the layout search and as the elastic builder's candidates, each of :data:`SEQ1F1B_KS`);
    ``plans_called``: its plans' name where it is not ``flag`` (the elastic builder's: ``epp``). Compared and hashed by
    flag and k."""

    flag: str
    build: Build = field(compare=False, repr=False)
    k: int | None = None
    plans_called: str | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return self.name

    @property
    def name(self) -> str:
        """The builder as flags, logs and the benchmark's JSON name it: ``elastic``, ``megatron``, ``seq1f1b-k4``."""
        return self._with_k(self.flag)

    @property
    def plan_name(self) -> str:
        """What its plans are called (``Plan.builder``, ``PlanReport.chosen``): ``epp``, ``megatron``, ``seq1f1b-k4``."""
        return self._with_k(self.plans_called or self.flag)

    def _with_k(self, name: str) -> str:
        return name if self.k is None else f"{name}-k{self.k}"

    def at(self, k: int) -> "Builder":
        """This builder with the fixed slice count ``k``."""
        return replace(self, k=k)

    @property
    def family(self) -> "Builder":
        """This builder without its fixed ``k``."""
        return replace(self, k=None)

    def variants(self) -> tuple["Builder", ...]:
        """The plans this builder stands for in a comparison: Seq1F1B without a ``k``, one per :data:`SEQ1F1B_KS`."""
        return tuple(self.at(k) for k in SEQ1F1B_KS) if self == SEQ1F1B else (self,)

    def flags(self) -> list[str]:
        """The ``--epp-*`` flags that run this builder."""
        return ["--epp-plan", self.flag] + ([] if self.k is None else ["--epp-max-slices", str(self.k)])

    def configure(self, config: PlannerConfig) -> PlannerConfig:
        """``config`` set to this builder (``builder``: its :attr:`family`, and ``max_slices`` = ``k`` where it has one):
        what :func:`plan_batch` and a run with :meth:`flags` plan with."""
        return replace(config, builder=self.family, max_slices=config.max_slices if self.k is None else self.k)

    def plan(self, lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig, known: BaselinePlans | None = None,
             validate: bool = True) -> PlannedStep:
        """This builder's plan of one global batch (one data-parallel replica) with its report; ``known``: baseline plans of the same
        lengths, cost model and config made before, taken from there where this builder's is (the elastic builder
        weighs those it needs); ``validate=False``: a score only. Raises :class:`PlanInfeasible` if nothing fits."""
        if known is not None and self in known:
            step = known[self]
            if step is None:
                raise PlanInfeasible(f"{self.plan_name} does not fit")
        else:
            step = self.build(lengths, cost_model, config if self.k is None else replace(config, max_slices=self.k), known)
        if validate:
            step.plan.validate()
        return step


BaselinePlans = Mapping[Builder, PlannedStep | None]  # baseline plans already made, by builder (None: it does not fit)


def baseline_builders(config: PlannerConfig) -> list[Builder]:
    """The baseline builders the elastic builder weighs: Megatron packing and Seq1F1B at each k of :data:`SEQ1F1B_KS`
    up to ``max_slices``."""
    return [MEGATRON] + [b for b in SEQ1F1B.variants() if b.k <= (config.max_slices or max(SEQ1F1B_KS))]


def baseline_candidates(lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig,
                        known: BaselinePlans | None = None) -> list[PlannedStep]:
    """The baseline plans the elastic builder weighs (:func:`baseline_builders`; not validated: the elastic builder's
    caller validates the one it chooses, those that do not fit left out; ``known``: as :meth:`Builder.plan`). Their
    uniform recompute is one of the answers the adaptive/greedy programs search over, so only those
    modes weigh them (``none`` takes them only without recompute; ``full`` never)."""
    if config.recompute == "full":
        return []
    steps = []
    for builder in baseline_builders(config):
        try:
            step = builder.plan(lengths, cost_model, config, known, validate=False)
        except PlanInfeasible:
            continue
        if config.recompute != "none" or step.plan.recomputed_layers() == 0:
            steps.append(step)
    return steps


def offload_choice(config: PlannerConfig, cost_model: CostModel) -> OffloadChoice:
    """The planner's offload: ``config.offload`` with its host budget per GPU (``--epp-host-memory-budget``, else the
    cost model's host link's default); a one-line ``ValueError`` where the cost model has no host link or the budget
    is more than the node holds."""
    if config.offload == "none":
        return NO_OFFLOAD
    host = cost_model.host
    if host is None:
        raise ValueError(f"--epp-offload {config.offload}: the cost model has no host memory and copy bandwidth "
                         "(a cluster preset's: --epp-cluster)")
    budget = host.default_budget_bytes() if config.host_memory_budget_bytes is None else config.host_memory_budget_bytes
    host.check_budget(budget)
    return OffloadChoice(config.offload, budget)


def _elastic_plan(lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig, known: BaselinePlans | None) -> PlannedStep:
    """EPP's own plan, or a baseline plan where that is predicted faster (the report's ``chosen``: which), named ``epp``."""
    t0 = time.perf_counter()
    candidates, error = [], None
    try:
        candidates.append(build_plan(lengths, cost_model, config.memory_budget_bytes, recompute=config.recompute,
                                     slice_counts=slice_counts(config), time_limit=config.time_limit,
                                     builder=ELASTIC.plan_name, offload=offload_choice(config, cost_model)))
    except PlanInfeasible as infeasible:
        error = infeasible
    candidates += baseline_candidates(lengths, cost_model, config, known)
    if not candidates:
        raise error or PlanInfeasible(f"no plan fits {config.memory_budget_bytes / GIB} GB per GPU")
    best = min(candidates, key=lambda c: c.report.predicted_step_ms)  # first wins ties: EPP's own plan
    report = replace(best.report, chosen=best.plan.builder,
                     candidates_ms={c.plan.builder: round(c.report.predicted_step_ms, 3) for c in candidates},
                     solve_ms=(time.perf_counter() - t0) * 1e3)
    return PlannedStep(replace(best.plan, builder=ELASTIC.plan_name), report)


def baseline_ratios(report: PlanReport) -> dict[str, float] | None:
    """The elastic builder's plan against the baselines it weighed on the same cost model (``report.candidates_ms``):
    Megatron packing's and the fastest Seq1F1B's predicted step time over the chosen plan's (> 1: the chosen plan is
    faster), keyed by their plan labels (``megatron``, ``seq1f1b-k2``); a baseline that does not fit (or that the
    recompute mode leaves out) is absent. None for a plan the elastic builder did not make."""
    candidates = report.candidates_ms
    if not candidates or report.chosen not in candidates:
        return None
    own = candidates[report.chosen]
    seq1f1b = [b.plan_name for b in SEQ1F1B.variants() if b.plan_name in candidates]
    labels = ([MEGATRON.plan_name] if MEGATRON.plan_name in candidates else []) + (
        [min(seq1f1b, key=candidates.__getitem__)] if seq1f1b else [])
    return {label: candidates[label] / own for label in labels}


def _megatron_plan(lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig, known: BaselinePlans | None) -> PlannedStep:
    return _uniform_plan(lengths, cost_model, config.memory_budget_bytes, config.max_seq_len, None, MEGATRON.plan_name)


def _seq1f1b_plan(lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig, known: BaselinePlans | None) -> PlannedStep:
    k = SEQ1F1B_K if config.max_slices is None else config.max_slices
    max_seq_len = config.max_seq_len
    L = np.asarray(lengths, dtype=np.int64)
    slice_tokens = max(max_seq_len // k, 1)
    long = L > slice_tokens
    cuts = [np.array([0, n]) for n in L]
    for i, c in zip(np.flatnonzero(long), equal_count_cuts(L[long], k, cost_model.work_vector(), max_seq_len)):
        cuts[i] = c
    return _uniform_plan(L, cost_model, config.memory_budget_bytes, slice_tokens, cuts, SEQ1F1B.at(k).plan_name)


ELASTIC = Builder("elastic", _elastic_plan, plans_called="epp")
MEGATRON = Builder("megatron", _megatron_plan)
SEQ1F1B = Builder("seq1f1b", _seq1f1b_plan)
BUILDERS: dict[str, Builder] = {b.flag: b for b in (ELASTIC, MEGATRON, SEQ1F1B)}  # by --epp-plan's name: the flag's choices


def plan_batch(lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig) -> PlannedStep:
    """The plan of one global batch (one data-parallel replica) by ``config.builder``, validated, with its report.
    Raises :class:`PlanInfeasible` if nothing fits."""
    return config.builder.plan(lengths, cost_model, config)
