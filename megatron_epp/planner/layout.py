"""The parallel layout search: which TP x CP x PP x DP to run a system with.

For a model, a cluster (:mod:`megatron_epp.cost.clusters`) and a batch of lengths, every layout
``tp x cp`` (inside a stage, within a node: tensor parallelism of 1, 2, 4, 8, 16 dividing the heads, times
context parallelism, Ulysses all-to-all, of 1, 2, 4, 8, 16 dividing the heads of a TP rank; ``cp`` > 1 for
EPP only, :data:`SYSTEM_CP`) ``x pp`` (dividing the layers) ``x dp`` (the rest of the world size; several
pipelines in parallel, the batch split over them as training splits it) is a candidate, and every one runs:
a layout is a :class:`~megatron_epp.base.dims.ParallelDims`, whose
:meth:`~megatron_epp.base.dims.ParallelDims.flags` are ``pretrain_gpt.py --elastic-pp``'s. A layout's step is the
slowest replica's simulated step (each replica planned by the system's builder on that layout's
cost model) plus the exposed data-parallel gradient sync: a reduce-scatter of fp32 gradients and an
all-gather of bf16 weights of the GPU's shard over the ``dp x cp`` ranks (megatron-core reduces gradients
and shards the distributed optimizer over DP x CP)
(:func:`~megatron_epp.cost.clusters.exposed_ms` with nothing to hide behind but the overlap share).

The search is exact and cheap: layouts are visited by their lower bound (the compute-only bound
of :meth:`CostModel.bound_ms` of the slowest replica, plus the sync) and it stops when the next
bound is no better than the best step found; ``exhaustive=True`` plans every layout. The answer is
the best layout and the runner-up with its time (why the best won: :attr:`LayoutChoice.reason`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from megatron_epp.base.dims import ParallelDims
from megatron_epp.cost.clusters import COMM_OVERLAP, Cluster, get_cluster, tp_profile
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.placement import place_profile
from megatron_epp.base.units import GIB
from megatron_epp.cost.shape import ModelShape
from megatron_epp.plan import PlannedStep, PlanInfeasible
from megatron_epp.planner.builders import ELASTIC, MEGATRON, SEQ1F1B, SEQ1F1B_KS, BaselinePlans, Builder
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.planner.data_parallel import dp_split


@dataclass
class LayoutResult:
    layout: ParallelDims
    step_ms: float
    bound_ms: float  # compute-only lower bound of this layout (slowest replica) + the exposed sync
    sync_ms: float
    plans: list[PlannedStep] = field(default_factory=list)  # per replica
    detail: str = ""  # e.g. Seq1F1B's k

    @property
    def peak_memory_bytes(self) -> float:
        """The highest predicted peak of any stage of any replica, model states included."""
        return float(max(max(p.report.peak_memory_bytes) for p in self.plans))

    @property
    def recomputed_layers(self) -> int:
        return int(sum(p.report.recomputed_layers for p in self.plans))


@dataclass
class LayoutChoice:
    best: LayoutResult
    runner_up: LayoutResult | None
    evaluated: list[LayoutResult]
    skipped: dict[str, str]  # layout -> why it was not planned (does not fit, pruned by its bound)

    @property
    def reason(self) -> str:
        b, r = self.best, self.runner_up
        if r is None:
            return f"{b.layout} is the only layout that fits"
        return f"{b.layout} {b.step_ms:.0f} ms beats {r.layout} {r.step_ms:.0f} ms (x{r.step_ms / b.step_ms:.2f})"


SIZES = (1, 2, 4, 8, 16)  # tensor- and context-parallel sizes the search tries


def enumerate_layouts(shape: ModelShape, cluster: Cluster, context_parallel: bool = True,
                      num_sequences: int | None = None) -> list[ParallelDims]:
    """Every layout of the cluster's world size for this model (see the module docstring); ``context_parallel``:
    with CP sizes above 1."""
    out = []
    tps = [s for s in SIZES if s <= cluster.gpus_per_node and shape.num_heads % s == 0]
    for tp in tps:
        cps = [c for c in (SIZES if context_parallel else (1,)) if tp * c <= cluster.gpus_per_node and (shape.num_heads // tp) % c == 0]
        for cp in cps:
            for pp in range(1, shape.num_layers + 1):
                if shape.num_layers % pp or cluster.world_size % (tp * cp * pp):
                    continue
                dims = ParallelDims.for_world(cluster.world_size, tp=tp, pp=pp, cp=cp)
                if num_sequences is None or dims.dp <= num_sequences:
                    out.append(dims)
    return out


def layout_cost_model(shape: ModelShape, cluster: Cluster, layout: ParallelDims) -> CostModel:
    """The cost model of ``layout`` on ``cluster``: the profile of a stage's ``tp`` GPUs (:func:`tp_profile`) placed on
    the layout (a stage's ``tp x cp`` GPUs inside a node: the CP group on NVLink) over the pipeline's network."""
    if layout.stage_size > cluster.gpus_per_node:
        raise ValueError(f"a stage of TP={layout.tp} x CP={layout.cp} GPUs: more than the node's {cluster.gpus_per_node}")
    network = cluster.network(layout.stage_size * layout.pp)
    return CostModel(place_profile(tp_profile(shape, cluster, layout.tp), layout, network), layout.pp, dp=layout.dp,
                     network=network, host=cluster.host)


def dp_sync_ms(cost_model: CostModel, cluster: Cluster, layout: ParallelDims, overlap: float = COMM_OVERLAP) -> float:
    """The exposed gradient sync of the slowest stage's GPU over its ``dp x cp`` ranks (fp32 reduce-scatter + bf16
    all-gather; the CP ranks hold the same weights)."""
    group = layout.dp * layout.cp
    if group == 1:
        return 0.0
    m = cost_model.profile.memory
    params = cost_model.model_state_bytes().max() / sum((m.weight, m.grad, m.optim / (group if m.distributed_optimizer else 1)))
    comm = cluster.strided_allgather_ms(4.0 * params, group, layout.tp * layout.pp)
    comm += cluster.strided_allgather_ms(2.0 * params, group, layout.tp * layout.pp)
    return (1.0 - overlap) * comm  # overlapped with the last backward at the overlap share (exposed_ms's floor)


def system_plan(system: Builder, L: np.ndarray, cm: CostModel, cfg: PlannerConfig,
                known: BaselinePlans | None = None) -> tuple[PlannedStep, str]:
    """A replica's plan by ``system`` and what it chose: :data:`ELASTIC` (the elastic planner, which also weighs
    Megatron's and Seq1F1B's plans; which won), :data:`MEGATRON` (packing, uniform recompute), :data:`SEQ1F1B` (the
    best k of :data:`SEQ1F1B_KS`; ``k<k>``), validated. ``known``: the baseline plans of those already made
    (:meth:`Builder.plan`'s, or None)."""
    if system == ELASTIC:
        step = ELASTIC.plan(L, cm, cfg, known)
        return step, step.report.chosen or ""
    if system == MEGATRON:
        return MEGATRON.plan(L, cm, cfg, known), ""
    if system == SEQ1F1B:
        made = []
        for variant in SEQ1F1B.variants():
            try:
                made.append((variant.plan(L, cm, cfg, known, validate=False), variant))
            except PlanInfeasible:
                continue
        if not made:
            raise PlanInfeasible(f"Seq1F1B: no k of {SEQ1F1B_KS} fits")
        best, variant = min(made, key=lambda m: m[0].report.predicted_step_ms)
        best.plan.validate()
        return best, f"k{variant.k}"  # the chosen k's plan only: the others are scores
    raise ValueError(f"unknown system {system.name!r}: elastic, megatron or seq1f1b")


def evaluate_layout(lengths: np.ndarray, shape: ModelShape, cluster: Cluster, layout: ParallelDims, system: Builder,
                    config: PlannerConfig, overlap: float = COMM_OVERLAP,
                    known: Sequence[BaselinePlans] | None = None) -> LayoutResult:
    """Plan every replica of ``layout`` with ``system``; raises :class:`PlanInfeasible` if one does not fit.
    ``known``: per replica, the baseline plans already made on this layout (:meth:`Builder.plan`)."""
    cm = layout_cost_model(shape, cluster, layout)
    sync = dp_sync_ms(cm, cluster, layout, overlap)
    parts = dp_split(lengths, layout.dp, cm.work_vector())
    plans, details = [], set()
    for i, p in enumerate(parts):
        plan, detail = system_plan(system, lengths[p], cm, config, None if known is None else known[i])
        plans.append(plan)
        details.add(detail)
    step = max(p.report.predicted_step_ms for p in plans) + sync
    bound = max(cm.bound_ms(lengths[p]) for p in parts) + sync
    return LayoutResult(layout, step, bound, sync, plans, "+".join(sorted(d for d in details if d)))


# whether a system's search tries context parallelism: EPP's does; the baselines are Megatron-LM's and Seq1F1B's
# published systems (TP x PP x DP), as the paper compares with (pretrain_gpt.py runs their plans at CP too)
SYSTEM_CP = {ELASTIC: True, MEGATRON: False, SEQ1F1B: False}
# the cheap plans that rank layouts before the expensive system plans the best few: for EPP the best of Megatron
# packing and Seq1F1B on the layout, an upper bound of EPP's step there (the elastic builder weighs both plans), so
# EPP's chosen layout is never slower than either baseline's best layout
PROXIES = {ELASTIC: (MEGATRON, SEQ1F1B), SEQ1F1B: (MEGATRON,)}
MAX_EVALUATED = 4  # layouts planned by an expensive system after the proxy ranking (exhaustive: all)


@dataclass
class _Candidate:
    """A layout that fits, with what the search needs of it: its cost model, replicas, sync and bound."""
    layout: ParallelDims
    cost_model: CostModel
    parts: list[np.ndarray]  # each replica's sequences
    sync: float
    replica_bounds: list[float]

    @property
    def name(self) -> str:
        return str(self.layout)

    @property
    def bound(self) -> float:
        return max(self.replica_bounds) + self.sync


class _Proxies:
    """The proxy step of a layout, ``min`` over the proxy baselines of ``max`` over its replicas (+ the sync): what
    :func:`evaluate_layout` of each baseline gives (``inf`` where a replica does not fit), planned one replica at a
    time, each plan once (not validated: scores); the plans are kept (:attr:`plans`) for the system's own planning
    of the layouts it keeps: the elastic builder weighs the same baseline plans."""

    def __init__(self, L: np.ndarray, system: Builder, config: PlannerConfig):
        self.L, self.config = L, config
        self.baselines = PROXIES[system]
        self.plans: dict[tuple[str, int], dict[Builder, PlannedStep | None]] = {}  # (layout, replica) -> builder -> plan

    def replica(self, c: _Candidate, baseline: Builder, r: int) -> float:
        """Replica ``r``'s step by ``baseline`` (its best plan, as :func:`system_plan`'s) plus the layout's sync
        (``inf``: it does not fit)."""
        made = self.plans.setdefault((c.name, r), {})
        steps = []
        for variant in baseline.variants():
            if variant not in made:
                try:
                    made[variant] = variant.plan(self.L[c.parts[r]], c.cost_model, self.config, validate=False)
                except PlanInfeasible:
                    made[variant] = None
            if made[variant] is not None:
                steps.append(made[variant].report.predicted_step_ms)
        return min(steps) + c.sync if steps else np.inf

    def order(self, c: _Candidate) -> list[int]:
        """Replicas heaviest first (by their bounds): the first to exceed a threshold if one does."""
        return sorted(range(len(c.parts)), key=lambda r: (-c.replica_bounds[r], r))

    def step_of(self, c: _Candidate, baseline: Builder) -> float:
        """``baseline``'s step on the layout: its slowest replica (``inf`` at the first that does not fit)."""
        worst = -np.inf
        for r in self.order(c):
            worst = max(worst, self.replica(c, baseline, r))
            if worst == np.inf:
                break
        return worst

    def step(self, c: _Candidate) -> float:
        return min(self.step_of(c, b) for b in self.baselines)

    def above(self, c: _Candidate, threshold: float) -> bool:
        """Whether the proxy step is finite and strictly above ``threshold``, planning as few replicas as that
        takes: every baseline has a replica above it (``max`` over replicas is then above), and one baseline
        fits every replica (else the proxy may be ``inf``, which ranks nothing: such a layout is planned)."""
        order = self.order(c)
        if not all(any(self.replica(c, b, r) > threshold for r in order) for b in self.baselines):
            return False
        return any(all(np.isfinite(self.replica(c, b, r)) for r in order) for b in self.baselines)


def _rank_by_proxy(cands: list[_Candidate], proxies: _Proxies, max_evaluated: int, skipped: dict[str, str]) -> list[_Candidate]:
    """The ``max_evaluated`` best layouts by proxy step (ties: bound, name), and every layout the proxy cannot rank
    (``inf``: no proxy plan fits it). Exact and lazy: layouts are visited by the first proxy baseline's step
    (Megatron packing: cheap, planned for all), and once ``max_evaluated`` proxies are known, a layout is only
    shown to be above the ``max_evaluated``-th best (:meth:`_Proxies.above`), not fully planned."""
    first = proxies.baselines[0]
    known: dict[str, float] = {}
    above: dict[str, float] = {}  # layout -> the threshold its proxy step is above
    visit = sorted(cands, key=lambda c: (proxies.step_of(c, first), c.bound, c.name))
    for c in visit:
        finite = sorted((v, b.bound, b.name) for b in visit if (v := known.get(b.name, np.inf)) < np.inf)
        if len(finite) >= max_evaluated and proxies.above(c, finite[max_evaluated - 1][0]):
            above[c.name] = finite[max_evaluated - 1][0]
            continue
        known[c.name] = proxies.step(c)
    ranked = sorted((c for c in cands if np.isfinite(known.get(c.name, np.inf))), key=lambda c: (known[c.name], c.bound, c.name))
    keep = ranked[:max_evaluated] + [c for c in cands if c.name in known and not np.isfinite(known[c.name])]
    kept = {c.name for c in keep}
    what = "/".join(b.name for b in proxies.baselines)
    for c in cands:
        if c.name in above:
            skipped[c.name] = f"proxy ({what}) > {above[c.name]:.0f} ms, outside the best {max_evaluated}"
        elif c.name not in kept:
            skipped[c.name] = f"proxy ({what}) {known[c.name]:.0f} ms outside the best {max_evaluated}"
    return keep


def _keep_by_proxy(cands: list[_Candidate], proxies: _Proxies, max_evaluated: int, skipped: dict[str, str]) -> list[_Candidate]:
    """The layouts the system plans: the ``max_evaluated`` best of all by proxy (:func:`_rank_by_proxy`) and, where some
    have context parallelism, the ``max_evaluated`` best of the TP layouts alone too (what the search without CP plans).
    The proxy is an upper bound of EPP's step, not a ranking of it: with CP layouts among the best ``max_evaluated``
    it would leave out TP layouts on which EPP plans a faster step than on those. Kept, the search with CP layouts
    plans a superset of what the search without them plans, so its step is never above that search's."""
    tp_only = [c for c in cands if c.layout.cp == 1]
    kept = _rank_by_proxy(cands, proxies, max_evaluated, skipped)
    if len(tp_only) == len(cands):
        return kept
    if len(tp_only) <= max_evaluated:
        tp_kept = tp_only
    else:
        tp_skipped: dict[str, str] = {}
        tp_kept = _rank_by_proxy(tp_only, proxies, max_evaluated, tp_skipped)
        for name, why in tp_skipped.items():
            skipped[name] = f"{why} TP layouts"
    names = {c.name for c in kept} | {c.name for c in tp_kept}
    for name in names:
        skipped.pop(name, None)
    return [c for c in cands if c.name in names]


def search_layout(lengths: Sequence[int], shape: ModelShape, cluster: Cluster, system: Builder, config: PlannerConfig,
                  context_parallel: bool | None = None, overlap: float = COMM_OVERLAP, exhaustive: bool = False,
                  max_evaluated: int = MAX_EVALUATED) -> LayoutChoice:
    """The best layout for ``system`` (module docstring). Raises :class:`PlanInfeasible` if none fits.
    ``context_parallel``: search CP sizes above 1 (None: :data:`SYSTEM_CP`).

    Unless ``exhaustive``: layouts whose lower bound is no better than the runner-up's step are not
    planned (exact), and when more than ``max_evaluated`` remain, only the ``max_evaluated`` best by a
    cheap proxy (:data:`PROXIES`: the best baseline step on the same layout) are planned by ``system``
    (for ``megatron`` itself the proxy is the answer: exact; with CP layouts among the candidates, the
    ``max_evaluated`` best TP layouts too, so CP layouts never push out what the search without them plans:
    :func:`_keep_by_proxy`), and every layout the proxy cannot rank
    (no proxy plan fits it: where memory binds, EPP's recompute and slicing may). The proxy ranking
    plans a layout's replicas only until its proxy step is shown to be outside the best
    ``max_evaluated`` (:func:`_rank_by_proxy`: the same layouts as planning them all)."""
    L = np.asarray(lengths, dtype=np.int64)
    cands, skipped = [], {}
    cp = SYSTEM_CP[system] if context_parallel is None else context_parallel
    for layout in enumerate_layouts(shape, cluster, cp, len(L)):
        cm = layout_cost_model(shape, cluster, layout)
        states = cm.model_state_bytes().max()
        if states >= config.memory_budget_bytes:
            skipped[str(layout)] = f"model states {states / GIB:.1f} GB per GPU"
            continue
        parts = dp_split(L, layout.dp, cm.work_vector())
        cands.append(_Candidate(layout, cm, parts, dp_sync_ms(cm, cluster, layout, overlap), [cm.bound_ms(L[p]) for p in parts]))
    known: dict[tuple[str, int], dict[Builder, PlannedStep | None]] = {}  # the proxy ranking's plans, by (layout, replica)
    if not exhaustive and system != MEGATRON and len(cands) > max_evaluated:
        proxies = _Proxies(L, system, config)
        cands = _keep_by_proxy(cands, proxies, max_evaluated, skipped)
        known = {key: plans for key, plans in proxies.plans.items() if any(key[0] == c.name for c in cands)}
    evaluated: list[LayoutResult] = []
    for c in sorted(cands, key=lambda c: (c.bound, c.name)):
        ranked = sorted(evaluated, key=lambda r: r.step_ms)
        if not exhaustive and len(ranked) >= 2 and c.bound >= ranked[1].step_ms:
            skipped[c.name] = f"bound {c.bound:.0f} ms >= runner-up's step"
            continue
        try:
            made = [known.pop((c.name, r), {}) for r in range(len(c.parts))]
            evaluated.append(evaluate_layout(L, shape, cluster, c.layout, system, config, overlap, known=made))
        except PlanInfeasible as e:
            skipped[c.name] = str(e)
    if not evaluated:
        raise PlanInfeasible(f"{system.plan_name}: no layout of {cluster.world_size} GPUs fits {config.memory_budget_bytes / GIB} GB per GPU")
    ranked = sorted(evaluated, key=lambda r: (r.step_ms, str(r.layout)))
    return LayoutChoice(ranked[0], ranked[1] if len(ranked) > 1 else None, ranked, skipped)


def cluster_for_world(cluster: Cluster, world_size: int) -> Cluster:
    """``cluster``'s nodes resized to ``world_size`` GPUs: one partial node, or whole nodes."""
    if world_size <= cluster.gpus_per_node:
        return cluster.with_nodes(1, world_size)
    if world_size % cluster.gpus_per_node:
        raise ValueError(f"world size {world_size} is not a whole number of {cluster.name}'s {cluster.gpus_per_node}-GPU nodes")
    return cluster.with_nodes(world_size // cluster.gpus_per_node)


def describe_choice(choice: LayoutChoice, cluster: Cluster, longest: dict[str, dict[str, LongestDocument]] | None = None) -> list[str]:
    """Lines that report a layout search: the best layout, why (the runner-up), the others (TP and TP x CP), with
    ``longest`` (:func:`longest_documents`) each one's longest single document, and last the best layout's
    ``pretrain_gpt.py`` flags."""
    best = choice.best
    lines = [f"layout search on {cluster.name} ({cluster.num_nodes} x {cluster.gpus_per_node} GPUs): best {best.layout}, "
             f"predicted step {best.step_ms:.1f} ms (bound {best.bound_ms:.1f} ms, DP sync {best.sync_ms:.1f} ms); {choice.reason}"]
    if longest is not None:
        lines.append(f"  {best.layout}: {describe_longest(longest[str(best.layout)])}")
    lines += [f"  {r.layout}: {r.step_ms:.1f} ms" + ("" if longest is None else f"; {describe_longest(longest[str(r.layout)])}")
              for r in choice.evaluated[1:]]
    lines += [f"  {name}: not planned ({why})" for name, why in sorted(choice.skipped.items())]
    lines.append(" ".join(best.layout.flags()))
    return lines


def search_for_world(lengths: Sequence[int], shape: ModelShape, cluster_name: str, world_size: int,
                     config: PlannerConfig) -> tuple[LayoutChoice, Cluster]:
    """EPP's best layout (TP x CP x PP x DP) for ``world_size`` GPUs of the preset ``cluster_name``."""
    cluster = cluster_for_world(get_cluster(cluster_name), world_size)
    return search_layout(lengths, shape, cluster, ELASTIC, config), cluster


LONGEST_STEP = 65536  # the longest-document search's resolution, tokens
LONGEST_MAX = 1 << 25  # and its ceiling (32M tokens)


@dataclass
class LongestDocument:
    """The longest single document the elastic planner fits on a layout (a multiple of :data:`LONGEST_STEP`; 0: not
    even one step), with its plan's predicted step, peak device and host memory per GPU, and why the next length fails."""

    tokens: int
    step: PlannedStep | None
    why_not_longer: str

    def row(self) -> dict:
        r = None if self.step is None else self.step.report
        return {"tokens": self.tokens, "step_ms": None if r is None else round(r.predicted_step_ms, 1),
                "peak_gb": None if r is None else round(max(r.peak_memory_bytes) / GIB, 1),
                "host_gb": None if r is None else round(max(r.host_memory_bytes or [0.0]) / GIB, 1),
                "copy_ms": None if r is None else round(r.copy_ms or 0.0, 1),
                "recomputed_layers": None if r is None else r.recomputed_layers,
                "chunks": None if r is None else sum(r.num_chunks.values()), "why_not_longer": self.why_not_longer}


def longest_document(shape: ModelShape, cluster: Cluster, layout: ParallelDims, config: PlannerConfig) -> LongestDocument:
    """The longest single document ``config`` (its offload mode and budgets) fits on ``layout``: lengths doubled from
    :data:`LONGEST_STEP` until the planner's feasibility check (a plan, or :class:`PlanInfeasible`) fails, then bisected
    to :data:`LONGEST_STEP` tokens. Fitting is taken as monotone in the length (a longer document needs more)."""
    cm = layout_cost_model(shape, cluster, layout)

    def plan(n: int) -> tuple[PlannedStep | None, str]:
        try:
            return ELASTIC.plan([n], cm, dataclasses.replace(config, max_seq_len=n)), ""
        except PlanInfeasible as e:
            return None, str(e)

    good, bad, best, why = 0, None, None, f"fits {LONGEST_MAX} tokens (the search's ceiling)"
    n = LONGEST_STEP
    while n <= LONGEST_MAX:
        step, reason = plan(n)
        if step is None:
            bad, why = n, reason
            break
        good, best, n = n, step, 2 * n
    while bad is not None and bad - good > LONGEST_STEP:
        mid = (good + bad) // 2 // LONGEST_STEP * LONGEST_STEP
        step, reason = plan(mid)
        if step is None:
            bad, why = mid, reason
        else:
            good, best = mid, step
    return LongestDocument(good, best, why)


def longest_documents(choice: LayoutChoice, shape: ModelShape, cluster: Cluster, config: PlannerConfig) -> dict[str, dict[str, LongestDocument]]:
    """Of every layout the search planned, the longest single document (:func:`longest_document`, one replica) without
    offload and, where ``config`` offloads, with its mode: ``{layout: {mode: LongestDocument}}``."""
    modes = ["none"] + ([config.offload] if config.offload != "none" else [])
    return {str(r.layout): {mode: longest_document(shape, cluster, r.layout, dataclasses.replace(config, offload=mode)) for mode in modes}
            for r in choice.evaluated}


def describe_longest(by_mode: dict[str, LongestDocument]) -> str:
    """One layout's longest documents, e.g. ``longest document 1,638,400 tokens without offload (step 1031 s); 6,291,456
    with --epp-offload checkpoints (step 14864 s, host 192.0 GB per GPU)``."""
    parts = []
    for mode, found in by_mode.items():
        r = found.row()
        how = "without offload" if mode == "none" else f"with --epp-offload {mode}"
        detail = "" if r["step_ms"] is None else f" (step {r['step_ms'] / 1e3:.0f} s" + ("" if mode == "none" else f", host {r['host_gb']} GB per GPU") + ")"
        parts.append(f"{r['tokens']:,} {how}{detail}")
    return "longest document " + "; ".join(parts)
