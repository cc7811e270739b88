"""The parallel layout search: which TP (or Ulysses SP + FSDP) x PP x DP to run a system with.

For a model, a cluster (:mod:`megatron_epp.cost.clusters`) and a batch of lengths, every layout
``intra x size`` (inside a stage, within a node; ``tp`` or ``sp``, sizes 1, 2, 4, 8 dividing the
heads) ``x pp`` (dividing the layers) ``x dp`` (the rest of the world size; several pipelines in
parallel, the batch split over them as training splits it) is a candidate. A layout's step is the
slowest replica's simulated step (each replica planned by the system's builder on that layout's
cost model) plus the exposed data-parallel gradient sync: a reduce-scatter of fp32 gradients and an
all-gather of bf16 weights of the GPU's shard over the ``dp`` replicas
(:func:`~megatron_epp.cost.clusters.exposed_ms` with nothing to hide behind but the overlap share).

The search is exact and cheap: layouts are visited by their lower bound (the compute-only bound
of :meth:`CostModel.bound_ms` of the slowest replica, plus the sync) and it stops when the next
bound is no better than the best step found; ``exhaustive=True`` plans every layout. The answer is
the best layout and the runner-up with its time (why the best won: :attr:`LayoutChoice.reason`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from megatron_epp.cost.clusters import COMM_OVERLAP, INTRA_MODES, Cluster, get_cluster, stage_profile
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.profiles import ModelShape
from megatron_epp.plan import Plan, PlanInfeasible
from megatron_epp.planner.builders import SEQ1F1B_KS, megatron_plan, plan_batch, seq1f1b_plan
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.planner.data_parallel import split_data_parallel



@dataclass(frozen=True)
class Layout:
    intra: str  # "tp" or "sp" inside a stage
    size: int  # GPUs per stage
    pp: int
    dp: int

    def __str__(self) -> str:
        return f"{self.intra.upper()}{self.size}xPP{self.pp}xDP{self.dp}"

    def flags(self) -> list[str]:
        """``pretrain_gpt.py``'s flags for this layout (data parallel = the rest of the world size)."""
        if self.intra == "sp" and self.size > 1:
            raise ValueError(f"{self}: Ulysses sequence parallelism is simulated only; pretrain_gpt.py runs TP layouts")
        return ["--tensor-model-parallel-size", str(self.size), "--pipeline-model-parallel-size", str(self.pp)]


@dataclass
class LayoutResult:
    layout: Layout
    step_ms: float
    bound_ms: float  # compute-only lower bound of this layout (slowest replica) + the exposed sync
    sync_ms: float
    plans: list[Plan] = field(default_factory=list)
    detail: str = ""  # e.g. Seq1F1B's k

    @property
    def peak_memory_gb(self) -> float:
        return float(max(max(p.stats.peak_memory_gb) for p in self.plans))

    @property
    def recomputed_layers(self) -> int:
        return int(sum(p.stats.recomputed_layers for p in self.plans))


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


def enumerate_layouts(shape: ModelShape, cluster: Cluster, intra_modes: Sequence[str] = INTRA_MODES,
                      num_sequences: int | None = None) -> list[Layout]:
    """Every layout of the cluster's world size for this model (see the module docstring)."""
    out = []
    sizes = [s for s in (1, 2, 4, 8, 16) if s <= cluster.gpus_per_node and shape.num_heads % s == 0]
    for intra in intra_modes:
        for size in sizes:
            if intra == "sp" and size == 1:
                continue  # the same as tp 1
            for pp in range(1, shape.num_layers + 1):
                if shape.num_layers % pp or cluster.world_size % (size * pp):
                    continue
                dp = cluster.world_size // (size * pp)
                if num_sequences is not None and dp > num_sequences:
                    continue
                out.append(Layout(intra, size, pp, dp))
    return out


def layout_cost_model(shape: ModelShape, cluster: Cluster, layout: Layout, overlap: float = COMM_OVERLAP) -> CostModel:
    profile = stage_profile(shape, cluster, layout.intra, layout.size, shape.num_layers // layout.pp, overlap)
    return CostModel(profile, layout.pp, dp=layout.dp, network=cluster.network(layout.size * layout.pp))


def dp_sync_ms(cost_model: CostModel, cluster: Cluster, layout: Layout, overlap: float = COMM_OVERLAP) -> float:
    """The exposed data-parallel gradient sync of the slowest stage's GPU (fp32 reduce-scatter + bf16 all-gather)."""
    if layout.dp == 1:
        return 0.0
    params = cost_model.model_state_bytes().max() / sum(
        (cost_model.profile.memory.weight, cost_model.profile.memory.grad,
         cost_model.profile.memory.optim / (layout.dp if cost_model.profile.memory.distributed_optimizer else 1)))
    comm = cluster.strided_allgather_ms(4.0 * params, layout.dp, layout.size * layout.pp)
    comm += cluster.strided_allgather_ms(2.0 * params, layout.dp, layout.size * layout.pp)
    return (1.0 - overlap) * comm  # overlapped with the last backward at the overlap share (exposed_ms's floor)


Builder = Callable[[np.ndarray, CostModel, PlannerConfig], tuple[Plan, str]]


def system_builder(system: str) -> Builder:
    """``epp`` (the elastic planner, which also weighs Megatron's and Seq1F1B's plans), ``megatron``
    (packing, uniform recompute), ``seq1f1b`` (fixed k, the best of :data:`SEQ1F1B_KS`)."""
    if system == "epp":
        return lambda L, cm, cfg: (lambda p: (p, p.stats.chosen or ""))(plan_batch(L, cm, replace(cfg, builder="elastic")))
    if system == "megatron":
        return lambda L, cm, cfg: (megatron_plan(L, cm, cfg), "")
    if system == "seq1f1b":
        def best_k(L: np.ndarray, cm: CostModel, cfg: PlannerConfig) -> tuple[Plan, str]:
            plans = []
            for k in SEQ1F1B_KS:
                try:
                    plans.append(seq1f1b_plan(L, cm, replace(cfg, max_slices=k)))
                except PlanInfeasible:
                    continue
            if not plans:
                raise PlanInfeasible(f"Seq1F1B: no k of {SEQ1F1B_KS} fits")
            best = min(plans, key=lambda p: p.stats.predicted_step_ms)
            return best, best.builder.replace("seq1f1b-", "")
        return best_k
    raise ValueError(f"unknown system {system!r}: epp, megatron or seq1f1b")


def evaluate_layout(lengths: np.ndarray, shape: ModelShape, cluster: Cluster, layout: Layout, system: str,
                    config: PlannerConfig, overlap: float = COMM_OVERLAP) -> LayoutResult:
    """Plan every replica of ``layout`` with ``system``; raises :class:`PlanInfeasible` if one does not fit."""
    cm = layout_cost_model(shape, cluster, layout, overlap)
    sync = dp_sync_ms(cm, cluster, layout, overlap)
    parts = split_data_parallel(lengths, layout.dp, cm.work_vector())
    build = system_builder(system)
    plans, details = [], set()
    for p in parts:
        plan, detail = build(lengths[p], cm, config)
        plans.append(plan)
        details.add(detail)
    step = max(p.stats.predicted_step_ms for p in plans) + sync
    bound = max(cm.bound_ms(lengths[p]) for p in parts) + sync
    return LayoutResult(layout, step, bound, sync, plans, "+".join(sorted(d for d in details if d)))


SYSTEM_INTRA = {"epp": INTRA_MODES, "megatron": ("tp",), "seq1f1b": ("tp",)}  # Megatron and Seq1F1B have no Ulysses SP
# the cheap plans that rank layouts before the expensive system plans the best few: for EPP the best of Megatron
# packing and Seq1F1B on the layout, an upper bound of EPP's step there (the elastic builder weighs both plans), so
# EPP's chosen layout is never slower than either baseline's best layout
PROXIES = {"epp": ("megatron", "seq1f1b"), "seq1f1b": ("megatron",)}
MAX_EVALUATED = 4  # layouts planned by an expensive system after the proxy ranking (exhaustive: all)


def search_layout(lengths: Sequence[int], shape: ModelShape, cluster: Cluster, system: str, config: PlannerConfig,
                  intra_modes: Sequence[str] | None = None, overlap: float = COMM_OVERLAP, exhaustive: bool = False,
                  max_evaluated: int = MAX_EVALUATED) -> LayoutChoice:
    """The best layout for ``system`` (module docstring). Raises :class:`PlanInfeasible` if none fits.

    Unless ``exhaustive``: layouts whose lower bound is no better than the runner-up's step are not
    planned (exact), and when more than ``max_evaluated`` remain, only the ``max_evaluated`` best by a
    cheap proxy (:data:`PROXIES`: the best baseline step on the same layout) are planned by ``system``
    (for ``megatron`` itself the proxy is the answer: exact), and every layout the proxy cannot rank
    (no proxy plan fits it: where memory binds, EPP's recompute and slicing may)."""
    L = np.asarray(lengths, dtype=np.int64)
    bounds, skipped = [], {}
    for layout in enumerate_layouts(shape, cluster, intra_modes or SYSTEM_INTRA[system], len(L)):
        cm = layout_cost_model(shape, cluster, layout, overlap)
        states = cm.model_state_bytes().max()
        if states >= config.memory_gb * 2**30:
            skipped[str(layout)] = f"model states {states / 2**30:.1f} GB per GPU"
            continue
        parts = split_data_parallel(L, layout.dp, cm.work_vector())
        sync = dp_sync_ms(cm, cluster, layout, overlap)
        bounds.append((max(cm.bound_ms(L[p]) for p in parts) + sync, str(layout), layout))
    bounds.sort(key=lambda b: (b[0], b[1]))
    if not exhaustive and system != "megatron" and len(bounds) > max_evaluated:
        proxy = {}
        for _, name, layout in bounds:
            proxy[name] = np.inf
            for baseline in PROXIES[system]:
                try:
                    step = evaluate_layout(L, shape, cluster, layout, baseline, config, overlap).step_ms
                except PlanInfeasible:
                    continue
                proxy[name] = min(proxy[name], step)
        # a layout the proxy cannot rank (no proxy plan fits it) is planned: the proxy says nothing of it
        ranked = sorted((b for b in bounds if np.isfinite(proxy[b[1]])), key=lambda b: (proxy[b[1]], b[0], b[1]))
        keep = ranked[:max_evaluated] + [b for b in bounds if not np.isfinite(proxy[b[1]])]
        for _, name, _ in bounds:
            if all(name != k[1] for k in keep):
                skipped[name] = f"proxy ({'/'.join(PROXIES[system])}) {proxy[name]:.0f} ms outside the best {max_evaluated}"
        bounds = keep
    evaluated: list[LayoutResult] = []
    for bound, name, layout in sorted(bounds, key=lambda b: (b[0], b[1])):
        ranked = sorted(evaluated, key=lambda r: r.step_ms)
        if not exhaustive and len(ranked) >= 2 and bound >= ranked[1].step_ms:
            skipped[name] = f"bound {bound:.0f} ms >= runner-up's step"
            continue
        try:
            evaluated.append(evaluate_layout(L, shape, cluster, layout, system, config, overlap))
        except PlanInfeasible as e:
            skipped[name] = str(e)
    if not evaluated:
        raise PlanInfeasible(f"{system}: no layout of {cluster.world_size} GPUs fits {config.memory_gb} GB per GPU")
    ranked = sorted(evaluated, key=lambda r: (r.step_ms, str(r.layout)))
    return LayoutChoice(ranked[0], ranked[1] if len(ranked) > 1 else None, ranked, skipped)


def cluster_for_world(cluster: Cluster, world_size: int) -> Cluster:
    """``cluster``'s nodes resized to ``world_size`` GPUs: one partial node, or whole nodes."""
    if world_size <= cluster.gpus_per_node:
        return cluster.with_nodes(1, world_size)
    if world_size % cluster.gpus_per_node:
        raise ValueError(f"world size {world_size} is not a whole number of {cluster.name}'s {cluster.gpus_per_node}-GPU nodes")
    return cluster.with_nodes(world_size // cluster.gpus_per_node)


def describe_choice(choice: LayoutChoice, cluster: Cluster) -> list[str]:
    """Lines that report a layout search: the best layout, why (the runner-up), the others, and last
    the best layout's ``pretrain_gpt.py`` flags (for an SP layout: a note that it is simulated only)."""
    best = choice.best
    lines = [f"layout search on {cluster.name} ({cluster.num_nodes} x {cluster.gpus_per_node} GPUs): best {best.layout}, "
             f"predicted step {best.step_ms:.1f} ms (bound {best.bound_ms:.1f} ms, DP sync {best.sync_ms:.1f} ms); {choice.reason}"]
    lines += [f"  {r.layout}: {r.step_ms:.1f} ms" for r in choice.evaluated[1:]]
    lines += [f"  {name}: not planned ({why})" for name, why in sorted(choice.skipped.items())]
    try:
        lines.append(" ".join(best.layout.flags()))
    except ValueError as note:
        lines.append(f"# {note}")
    return lines


def search_for_world(lengths: Sequence[int], shape: ModelShape, cluster_name: str, world_size: int, config: PlannerConfig,
                     runnable_only: bool) -> tuple[LayoutChoice, Cluster]:
    """EPP's best layout for ``world_size`` GPUs of the preset ``cluster_name``; ``runnable_only``: TP
    layouts (what ``pretrain_gpt.py`` runs), else TP and Ulysses SP."""
    cluster = cluster_for_world(get_cluster(cluster_name), world_size)
    return search_layout(lengths, shape, cluster, "epp", config, intra_modes=("tp",) if runnable_only else None), cluster
