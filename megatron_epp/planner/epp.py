"""``build_plan``: the elastic pipeline planner (the paper's sequence processor), end to end.

0. a batch that cannot fit whatever the plan (model states, the longest sequence's least memory)
   is refused with the reason (:func:`check_fits`);
1. chunking (:mod:`chunking`) over a grid: slice budgets ``T_t = work(longest sequence) / K`` for
   every slice count ``K``, and token caps ``T_m`` from the longest sequence down a geometric grid
   (:func:`token_caps`, the memory cap :func:`token_cap` included); fixed-length chunks (no
   workload balance) over the same caps. Each chunking is scored by its slowest stage's compute
   plus the grouping overhead (bubbles and estimated recompute); one that no grouping fits is dropped;
2. grouping (:mod:`grouping`) into consecutive 1F1B pipelines. Finalists: the best of each family
   (balanced or fixed-length chunks, recompute allowed or not) and the packing-only chunking;
3. recompute (:mod:`.recompute`) per pipeline on the exact memory walk (:mod:`memory`), and the
   full-recompute variant;
4. simulation (:mod:`simulator`) of every finalist: the fastest predicted step wins, its numbers in
   its report (:class:`~megatron_epp.plan.PlanReport`, beside the plan in a :class:`~megatron_epp.plan.PlannedStep`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from megatron_epp.plan import Pipeline, Plan, PlanInfeasible, PlannedStep
from megatron_epp.planner.recompute import Offload, OffloadSetting, Recompute
from megatron_epp.planner.recompute import MemoryInfeasible, solve_recompute
from megatron_epp.simulator.offload import kv_copy_bytes, kv_host_copy_ms
from megatron_epp.planner.chunking import PACK_RELAX, Chunking, build_units
from megatron_epp.cost.features import F, chunk_features, sequence_features
from megatron_epp.cost.model import ChunkCosts, CostModel
from megatron_epp.planner.grouping import group_units_both
from megatron_epp.simulator.memory import pipeline_memory
from megatron_epp.base.units import GIB
from megatron_epp.planner.stats import ChunkingChoice, ProgramSummary, planned_step
from megatron_epp.simulator.step import SimResult, simulate

SLICE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
MIN_CHUNK_TOKENS = 64  # the smallest token cap searched
REGROUP_TRIES = 3  # regroupings of a finalist the exact walk finds short of memory
FINALISTS_PER_FAMILY = 1  # candidates of a family simulated: the estimate ranks them only roughly
FINALIST_TRIES = 8  # candidates of a family tried, best estimate first, until the exact memory walk fits one
CAP_RATIO = 2.0  # the token caps searched: a geometric grid of this ratio ...
CAP_FLOOR_FRACTION = 1 / 32  # ... down to this fraction of the smaller of the longest sequence and the memory cap


def token_cap(cost_model: CostModel, budget: float) -> int:
    """Largest chunk (one sequence) whose activations on stage 0, ``P`` chunks in flight without
    recompute, fit beside the model states: the default bucket token cap ``T_m``."""
    m, L0, P = cost_model.profile.memory, float(cost_model.layers[0]), cost_model.num_stages
    free = max(budget - cost_model.model_state_bytes()[0], 0.0) / P
    a, b = L0 * m.act_area, L0 * m.act_token
    t = free / b if a == 0 else (-b + np.sqrt(b * b + 4 * a * free)) / (2 * a)
    return max(int(t), 1)


def order_units(chunking: Chunking, w: np.ndarray) -> tuple[Chunking, np.ndarray]:
    """Units with more chunks first (ties: more work first), as the elastic 1F1B order wants; and
    the features of their chunks in that order. ``w``: the work vector."""
    feats = chunking.features()
    sizes = chunking.unit_sizes
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    order = np.lexsort((-np.add.reduceat(feats @ w, starts), -sizes))
    rows = np.concatenate([np.arange(starts[u], starts[u] + sizes[u]) for u in order])
    return chunking.take(rows, sizes[order]), feats[rows]


def make_plan(lengths: Sequence[int], cost_model: CostModel, chunking: Chunking, groups: list[tuple[int, int]], builder: str) -> Plan:
    """Plan with the given pipelines (ranges ``[first, end)`` of the chunking's units), chunk ids in
    execution order, no recompute."""
    pipes, next_id = [], 0
    for a, b in groups:
        chunks = chunking.chunks(a, b, next_id)
        next_id += len(chunks)
        pipes.append(Pipeline(chunks, [[0] * len(chunks) for _ in range(cost_model.num_stages)]))
    return Plan(list(map(int, lengths)), cost_model.num_stages, cost_model.layers.tolist(), pipes, builder)


@dataclass(frozen=True)
class OffloadChoice:
    """Activation offload for the planner: ``mode`` (``--epp-offload``) and the host budget per GPU in bytes."""

    mode: Offload = "none"
    host_budget: float = 0.0


NO_OFFLOAD = OffloadChoice()


def apply_recompute(plan: Plan, cost_model: CostModel, budget: float, mode: Recompute, time_limit: float, mip_rel_gap: float,
                    offload: OffloadChoice = NO_OFFLOAD) -> ProgramSummary:
    """Decide every pipeline's recompute (and offload) in place; returns the solver's summary."""
    states = cost_model.model_state_bytes()
    gaps, methods, rc = [], set(), 0.0
    for pipe in plan.pipelines:
        costs = cost_model.costs(chunk_features(pipe.chunks))
        if offload.mode == "none":
            res = solve_recompute(pipeline_memory(pipe, costs, cost_model.layers, states), costs.rc_layer, cost_model.layers, budget, mode, time_limit, mip_rel_gap)
        else:
            res = _solve_with_offload(pipe, costs, cost_model, budget, mode, time_limit, mip_rel_gap, offload)
        pipe.recompute = res.recompute
        gaps.append(res.gap)
        methods.add(res.method)
        rc += res.recompute_ms
    return ProgramSummary(mip_gap=float(max(gaps)), recompute_method="+".join(sorted(methods)), program_recompute_ms=rc)


def _solve_with_offload(pipe: Pipeline, costs: ChunkCosts, cost_model: CostModel, budget: float, mode: Recompute,
                        time_limit: float, mip_rel_gap: float, offload: OffloadChoice):
    """The pipeline's recompute and checkpoint offload (set in place: ``offload``, empty where nothing is offloaded);
    under ``auto``, where the device cannot fit the pipeline with its K/V buffers, again with every split sequence's
    buffer on the host (``kv_host``)."""
    states, layers = cost_model.model_state_bytes(), cost_model.layers
    split = sorted({c.segments[-1].seq for c in pipe.chunks if c.kind == "split"})

    def solve():
        setting = OffloadSetting(cost_model.host, offload.host_budget, costs.fwd, costs.bwd, kv_copy_bytes(pipe, costs, layers))
        return solve_recompute(pipeline_memory(pipe, costs, layers, states), costs.rc_layer, layers, budget, mode, time_limit,
                               mip_rel_gap, setting)

    try:
        res = solve()
    except MemoryInfeasible as e:
        if offload.mode != "auto" or not split or type(e) is not MemoryInfeasible:
            raise
        pipe.kv_host = split
        res = solve()
    pipe.offload = res.offload if any(map(any, res.offload)) else []
    return res


def finish(plan: Plan, cost_model: CostModel, budget: float, t0: float) -> PlannedStep:
    """Simulate ``plan`` and give it with its report (:func:`~megatron_epp.planner.stats.planned_step`), not validated
    (:meth:`~megatron_epp.planner.builders.Builder.plan` validates); for the uniform builders."""
    solve_ms = (time.perf_counter() - t0) * 1e3
    return planned_step(plan, cost_model, simulate(plan, cost_model), budget, solve_ms)


def least_sequence_bytes(cost_model: CostModel, n: int) -> np.ndarray:
    """Per stage, a lower bound on what one sequence of ``n`` tokens holds besides the model states
    in any plan: split, its K/V buffer (``kv_token`` per token and layer); whole, every layer's input
    even if all are checkpointed (``ckpt_token``); the cheaper of the two."""
    m = cost_model.profile.memory
    return cost_model.layers * min(m.kv_token, m.ckpt_token) * float(n)


def check_fits(lengths: np.ndarray, cost_model: CostModel, budget: float, offload: OffloadChoice = NO_OFFLOAD) -> None:
    """Raise :class:`PlanInfeasible` with the reason in one line when the batch cannot fit whatever
    the plan: the model states alone, or with the least the longest sequence needs (with offload: on the device and
    the host budget together)."""
    states, n = cost_model.model_state_bytes(), int(lengths.max())
    need = states + least_sequence_bytes(cost_model, n)
    p = int(np.argmax(need - budget))
    if states[p] >= budget:
        raise PlanInfeasible(f"model states take {in_units(states[p], budget)} per GPU on stage {p}: nothing fits")
    if offload.mode != "none":
        p = int(np.argmax(need - budget - offload.host_budget))
        if need[p] > budget + offload.host_budget:
            raise PlanInfeasible(
                f"the longest sequence ({n} tokens) needs at least {in_units(need[p] - budget)} of host memory per GPU on "
                f"stage {p} (its K/V buffer if split, its checkpointed layer inputs if whole, beyond the device's "
                f"{in_units(budget - states[p])} free): more than --epp-host-memory-budget {offload.host_budget / GIB:g} GB")
        return
    if need[p] > budget:
        raise PlanInfeasible(
            f"model states take {in_units(states[p], budget)} per GPU on stage {p}; the longest sequence "
            f"({n} tokens) needs at least {in_units(need[p] - states[p])} more (its K/V buffer if split, its "
            f"checkpointed layer inputs if whole)")


def in_units(*sizes: float) -> str:
    """Byte counts in one unit, GB, MB or KB (binary, as the budget's GB), the largest that shows the largest
    size as at least 1: ``17.3 of 20.0 GB``, ``3.2 of 48.0 MB`` (a budget under 1 GB is no ``0.0 of 0.0 GB``)."""
    unit, scale = next(((u, s) for u, s in (("GB", GIB), ("MB", GIB / 1024), ("KB", GIB / 1024**2)) if max(sizes) >= s),
                       ("KB", GIB / 1024**2))
    return " of ".join(f"{size / scale:.1f}" for size in sizes) + f" {unit}"


@dataclass(frozen=True, eq=False)
class Candidate:
    """A chunking a grouping fits: its proxy score, the key it was searched under (slice budget, token cap,
    balance), the chunking and its pipelines (ranges ``[first, end)`` of its units)."""

    score: float
    slice_budget: float
    cap: int
    balance: bool
    chunking: Chunking
    groups: list[tuple[int, int]]

    @property
    def identity(self) -> tuple:
        """One chunking under several keys (a cap that binds everywhere makes the slice budget moot) is one
        candidate: identified by the chunking, which the search's cache shares, and its grouping."""
        return id(self.chunking), tuple(self.groups)


@dataclass(frozen=True)
class _Finalist:
    """A finalist's plan with its recompute decided and simulated, and what its report takes from the search."""

    plan: Plan
    sim: SimResult
    program: ProgramSummary
    chunking: ChunkingChoice


@dataclass
class _Search:
    """The chunkings of one batch, computed once and shared by every family of candidates."""

    lengths: np.ndarray
    cost_model: CostModel
    free: float  # stage 0's budget minus its model states
    offload: Offload = "none"  # what the grouping estimate may count off the device (group_units_both)
    kv_on_host: bool = False  # auto's second round: every split sequence's K/V buffer taken to be on the host
    cache: dict = field(default_factory=dict)  # chunkings by (slice budget, cap, balance)
    groupings: dict = field(default_factory=dict)  # their groupings with and without recompute

    def units(self, budget_t: float, cap: int, balance: bool) -> tuple[Chunking, ChunkCosts]:
        w = self.cost_model.work_vector()
        if balance and (w >= 0).all() and w[F.S] > 0:  # no chunk holds more tokens than its relaxed budget's worth:
            cap = min(cap, int(budget_t * (1 + PACK_RELAX) / w[F.S]) + 1)  # larger caps give the same chunking
        key = (budget_t, cap, balance)
        if key not in self.cache:
            units, feats = order_units(build_units(self.lengths, w, budget_t, cap, balance), w)
            self.cache[key] = units, self.cost_model.costs(feats)
        return self.cache[key]

    def score(self, budget_t: float, cap: int, balance: bool, recompute: bool, margin: float = 0.0) -> Candidate | None:
        """One chunking with its grouping and proxy score (slowest stage's compute plus the grouping overhead:
        bubbles, estimated recompute); None if no grouping fits. ``margin``: bytes the grouping keeps free beyond
        its estimate (what the exact walk found it short). Under ``auto``, a chunking that fits only with its split
        sequences' K/V buffers on the host (by the estimate; in the second round, ``kv_on_host``, every chunking, as the
        exact walk put them there in the first) is also charged the copies of those buffers that no compute hides
        (:func:`~megatron_epp.simulator.offload.kv_host_copy_ms`, the slowest stage's): slices too short for their
        prefix fetches to hide behind their attention rank lower."""
        chunking, costs = self.units(budget_t, cap, balance)
        key = (id(chunking), margin, self.kv_on_host)  # one grouping per distinct chunking (equivalent caps share one)
        if key not in self.groupings:
            self.groupings[key] = self._group(chunking, costs, margin)
        groups, overhead = self.groupings[key][recompute]
        if not np.isfinite(overhead):
            return None
        return Candidate(float((costs.fwd + costs.bwd).sum(axis=1).max()) + overhead, budget_t, cap, balance, chunking, groups)

    def _group(self, chunking: Chunking, costs: ChunkCosts, margin: float) -> dict[bool, tuple[list[tuple[int, int]], float]]:
        """:func:`group_units_both` of the chunking; under ``auto``, the grouping with the K/V buffers on the device
        where one fits, else the one with them on the host plus their exposed copy time."""
        sizes, layers = chunking.unit_sizes.tolist(), self.cost_model.layers
        both = group_units_both(sizes, costs, layers, self.free - margin, offload=self.offload)
        if self.offload != "auto":
            return both
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        units = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b - a > 1]
        copy = float(kv_host_copy_ms(units, costs, layers, self.cost_model.host).max()) if units else 0.0
        charged = {rc: (both[rc][0], both[rc][1] + copy) for rc in both}
        if self.kv_on_host:
            return charged
        device = group_units_both(sizes, costs, layers, self.free - margin, offload="checkpoints")
        return {rc: device[rc] if np.isfinite(device[rc][1]) else charged[rc] for rc in both}


def token_caps(longest: int, memory_cap: int) -> list[int]:
    """The chunk token caps searched, largest first: a geometric grid (ratio :data:`CAP_RATIO`) from the
    longest sequence down to :data:`CAP_FLOOR_FRACTION` of the smaller of it and the memory cap
    (never below :data:`MIN_CHUNK_TOKENS`), and the memory cap itself, its half and its quarter."""
    top = max(int(longest), MIN_CHUNK_TOKENS)
    floor = max(MIN_CHUNK_TOKENS, int(min(top, memory_cap) * CAP_FLOOR_FRACTION))
    caps = {max(MIN_CHUNK_TOKENS, min(memory_cap, top) // d) for d in (1, 2, 4)}
    c = float(top)
    while c >= floor:
        caps.add(int(c))
        c /= CAP_RATIO
    return sorted(caps, reverse=True)


def _family(search: _Search, balance: bool, recompute: bool, caps: list[int], start_cap: int,
            slice_counts: Sequence[int]) -> list[Candidate]:
    """Candidates of one family that the grouping estimate fits, best first. ``balance``: slice budgets ``work(longest) / K`` (only those at least a first
    slice of :data:`MIN_CHUNK_TOKENS` tokens' work); a full scan of every ``K`` at
    ``start_cap`` (if none fits there, the caps downwards with the fewest and the most slices until one
    does), then of every cap at the best ``K`` and of every ``K`` at the best cap, twice (no early stop).
    Else fixed-length chunks of every cap and of ``longest / K`` tokens (at least :data:`MIN_CHUNK_TOKENS`)."""
    longest = int(search.lengths.max())
    found: dict[tuple, Candidate | None] = {}

    def scan(keys) -> None:
        for t, c in keys:
            if (t, c) not in found:
                found[t, c] = search.score(t, c, balance, recompute)

    def ranked() -> list[Candidate]:
        return sorted((f for f in found.values() if f is not None), key=lambda f: f.score)

    smallest = min(MIN_CHUNK_TOKENS, longest, caps[0])  # no slice shorter than the smallest token cap searched
    if not balance:
        scan([(np.inf, t) for t in sorted({max(smallest, min(caps[0], longest // k)) for k in slice_counts} | set(caps), reverse=True)])
        return ranked()
    w = search.cost_model.work_vector()
    work, least = (float(f @ w) for f in sequence_features([longest, smallest]))
    # slice budgets below a first slice of the smallest cap's work cut slices of a few tokens (1-token chunks where
    # the budget is below the per-chunk constant): never a good plan, and a recompute program the size of the batch
    counts = [k for k in slice_counts if work / k >= least] or [min(slice_counts)]
    scan([(work / k, start_cap) for k in counts])
    for c in caps:  # nothing fits at the start: down the caps (the fewest and the most slices) until one does
        if ranked():
            break
        scan([(work / k, c) for k in sorted({min(counts), max(counts)})])
    for _ in range(2):  # every cap at the best slice budget, then every slice budget at the best cap
        if ranked():
            t = ranked()[0].slice_budget
            scan([(t, cap) for cap in caps])
            c = ranked()[0].cap
            scan([(work / k, c) for k in counts])
    return ranked()


def build_plan(
    lengths: Sequence[int],
    cost_model: CostModel,
    budget_bytes: float,
    *,
    recompute: Recompute = "adaptive",
    balance: bool = True,
    slice_counts: Sequence[int] = SLICE_COUNTS,
    time_limit: float = 1.0,
    mip_rel_gap: float = 0.01,
    builder: str = "epp",
    offload: OffloadChoice = NO_OFFLOAD,
) -> PlannedStep:
    """Elastic pipeline plan of one global batch (one data-parallel replica), with its report.

    ``budget_bytes``: per GPU. ``recompute``: ``"adaptive"`` (the integer program), ``"greedy"``,
    ``"none"`` or ``"full"``. ``balance=False``: even slices and token-only packing into chunks of
    a searched fixed length (the "w/o workload balance" ablation).

    Candidates: four families, workload-balanced or fixed-length chunks (the latter only) each with
    or without recompute allowed (per ``recompute``), each searched over every slice count and token
    cap of :func:`token_caps`; the best of each family by the proxy score, and the packing-only
    chunking, are finalists; each finalist gets its recompute (in ``adaptive``/``greedy`` mode also
    the full-recompute variant of those that need some) and is simulated; the fastest wins. The
    finalists of the ablations ``recompute="none"``, ``"full"`` and ``balance=False`` are among
    those of the default, so it is never predicted slower than they are.
    ``offload``: checkpoints (and, ``auto``, split sequences' K/V buffers) may go to host memory (docs/planner.md,
    "Activation offload"; the cost model's ``host`` link); the default plans as before offload existed.
    Under ``auto`` the plan keeping every K/V buffer on the device (``checkpoints``'s) is planned too and the faster
    of the two kept: ``auto``'s search may end on chunkings whose buffers the host cannot hold where a chunking of
    ``checkpoints`` (one whole chunk) fits, so ``auto`` never fits less than ``checkpoints``.
    Raises :class:`PlanInfeasible` (the reason in one line) if nothing fits.
    """
    kwargs = dict(recompute=recompute, balance=balance, slice_counts=slice_counts, time_limit=time_limit, mip_rel_gap=mip_rel_gap,
                  builder=builder)
    if offload.mode != "auto":
        return _build_plan(lengths, cost_model, budget_bytes, offload=offload, **kwargs)
    t0, steps, errors = time.perf_counter(), [], []
    for mode in ("auto", "checkpoints"):
        try:
            steps.append(_build_plan(lengths, cost_model, budget_bytes, offload=replace(offload, mode=mode), **kwargs))
        except PlanInfeasible as error:
            errors.append(error)
    if not steps:
        raise errors[0]
    best = min(steps, key=lambda step: step.report.predicted_step_ms)  # auto's first: it wins ties
    return replace(best, report=replace(best.report, solve_ms=(time.perf_counter() - t0) * 1e3))  # both searches' time


def _build_plan(
    lengths: Sequence[int],
    cost_model: CostModel,
    budget_bytes: float,
    *,
    recompute: Recompute,
    balance: bool,
    slice_counts: Sequence[int],
    time_limit: float,
    mip_rel_gap: float,
    builder: str,
    offload: OffloadChoice,
) -> PlannedStep:
    """:func:`build_plan` for one offload mode."""
    t0 = time.perf_counter()
    L = np.asarray(lengths, dtype=np.int64)
    if len(L) == 0 or (L < 1).any():
        raise PlanInfeasible("the batch must hold sequences of at least one token")
    check_fits(L, cost_model, budget_bytes, offload)
    memory_cap = token_cap(cost_model, budget_bytes)
    caps = token_caps(int(L.max()), memory_cap)
    search = _Search(L, cost_model, budget_bytes - cost_model.model_state_bytes()[0], offload.mode)
    flags = [f for f, allowed in ((True, recompute != "none"), (False, recompute != "full")) if allowed]
    start_cap = min(memory_cap, caps[0])

    def families() -> list[tuple[bool, list[Candidate]]]:
        finalists = [(rc, _family(search, b, rc, caps if rc else ([c for c in caps if c <= start_cap] or [start_cap]), start_cap, slice_counts))
                     for b in ((True, False) if balance else (False,)) for rc in flags]
        if balance and recompute != "full":  # packing only: one slice budget, the longest sequence's work
            finalists.append((False, _family(search, True, False, [start_cap], start_cap, [1])))
        return finalists

    modes = [recompute] + (["full"] if recompute in ("adaptive", "greedy") else [])
    how = _Recompute(modes, budget_bytes, time_limit, mip_rel_gap, offload)
    plans, reasons = _simulate_finalists(search, families(), how, builder)
    if offload.mode == "auto" and any(f.sim.copy_ms > 0 and any(p.kv_host for p in f.plan.pipelines) for f in plans):
        # the exact walk put K/V buffers on the host where the estimate had them fit on the device: the chunkings are
        # searched again with every split sequence's K/V on the host and its exposed copies charged, and the best
        # simulated beside the first round's
        search.kv_on_host = True
        more, _ = _simulate_finalists(search, families(), how, builder)
        plans += more
    if not plans:
        why = reasons[0] if reasons else f"no grouping fits even with chunks of {caps[-1]} tokens"
        raise PlanInfeasible(f"no {recompute!r} plan fits {budget_bytes / GIB} GB per GPU: {why}")
    best = min(plans, key=lambda f: f.sim.step_ms)  # first wins ties
    best.plan.validate()
    return planned_step(best.plan, cost_model, best.sim, budget_bytes, (time.perf_counter() - t0) * 1e3, best.program, best.chunking)


@dataclass(frozen=True)
class _Recompute:
    """How a finalist's recompute is decided: the modes tried (its own, and the full variant), the budget in bytes
    and the program's limits."""

    modes: list[Recompute]
    budget: float
    time_limit: float
    mip_rel_gap: float
    offload: OffloadChoice = NO_OFFLOAD


def _evaluate(search: _Search, cand: Candidate, rc: bool, how: _Recompute, builder: str) -> list[_Finalist]:
    """The candidate's plans (its recompute, and the full variant), regrouped with the margin the exact walk finds
    the grouping estimate short by; raises MemoryInfeasible if it stays short."""
    margin, cm = 0.0, search.cost_model
    for attempt in range(REGROUP_TRIES):
        try:
            out: list[_Finalist] = []
            for mode in how.modes:
                if out and out[-1].plan.recomputed_layers() == 0:
                    break  # needs no recompute: the full variant is only slower
                plan = make_plan(search.lengths, cm, cand.chunking, cand.groups, builder)
                program = apply_recompute(plan, cm, how.budget, mode, how.time_limit, how.mip_rel_gap, how.offload)
                out.append(_Finalist(plan, simulate(plan, cm), program, ChunkingChoice(cand.slice_budget, cand.cap)))
            return out
        except MemoryInfeasible as e:
            margin += e.excess_bytes
            regrouped = search.score(cand.slice_budget, cand.cap, cand.balance, rc, margin)
            if regrouped is None or attempt == REGROUP_TRIES - 1:
                raise
            cand = regrouped
    raise AssertionError("unreachable")


def _simulate_finalists(search: _Search, finalists: list[tuple[bool, list[Candidate]]], how: _Recompute,
                        builder: str) -> tuple[list[_Finalist], list[str]]:
    """Of each family (recompute allowed or not, its candidates best first), the best that the exact memory walk
    fits, each planned and simulated; and why those that did not fit failed."""
    seen, plans, reasons = set(), [], []
    without = replace(how, modes=["none"])
    for rc, family in finalists:
        kept = 0
        for cand in family[:FINALIST_TRIES]:  # the best by the estimate that the exact walk fits
            if not rc and how.modes != without.modes and (cand.identity, "none") not in seen:
                # also planned as the no-recompute ablation plans it (regrouped until it fits without any): the same
                # chunking may be faster in more 1F1B pipelines without recompute than in fewer with it
                seen.add((cand.identity, "none"))
                try:
                    plans += _evaluate(search, cand, rc, without, builder)
                except MemoryInfeasible:
                    pass  # it needs recompute: planned with it below (or in the recompute family)
            if cand.identity in seen:
                continue
            seen.add(cand.identity)
            try:
                plans += _evaluate(search, cand, rc, how, builder)
            except MemoryInfeasible as e:
                reasons.append(str(e))
                continue
            kept += 1
            if kept == FINALISTS_PER_FAMILY:
                break
    return plans, reasons
