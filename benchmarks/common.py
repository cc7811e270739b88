"""What the benchmarks share (one place each): their command lines' parsing and errors, the in-process planning
of a run's own batches at a budget, the per-step statistics of measured runs, and their data (the Wikipedia-length
documents, the paper grid's length distributions).

Run a benchmark from the repository's root as ``python -m benchmarks.NAME`` (the root on the path, as pytest's
``pythonpath`` puts it for the tests)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Collection, NoReturn, Sequence

import numpy as np

from megatron_epp.base.options import int_list
from megatron_epp.base.units import GIB
from megatron_epp.cost.model import CostModel
from megatron_epp.data.lengths import read_lengths
from megatron_epp.data.mock_documents import WIKIPEDIA_LENGTHS
from megatron_epp.plan import Plan, PlannedStep, PlanInfeasible
from megatron_epp.planner.builders import ELASTIC, MEGATRON, Builder, plan_batch
from megatron_epp.planner.config import PlannerConfig

if TYPE_CHECKING:
    from megatron_epp.training.metrics import StepMetrics

REPO = Path(__file__).resolve().parents[1]
GRID_GB = 1 / 1024  # budget resolution: exact in binary, so the printed value is the one planned
MAX_BUDGET_GB = 4096.0
LENGTH_POOLS = ("commoncrawl", "github", "code-heavy", "wikipedia")


# --------------------------------------------------------------------------------------------- command lines


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, as argparse's errors and ``pretrain_gpt.py``'s (``PROG: error: ...``), named after the
    script that runs, and exit ``code`` (2: bad input, as argparse)."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are :func:`fail`'s one line and exit 2 (no usage block), as
    ``pretrain_gpt.py``'s."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        fail(message)


def subset_of(known: Collection[str]) -> Callable[[str], list[str]]:
    """An argparse ``type``: a comma-separated, non-empty subset of ``known``."""

    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        unknown = [v for v in values if v not in known]
        if not values or unknown:
            raise argparse.ArgumentTypeError(f"{text!r}: unknown {', '.join(unknown) or '(none given)'} "
                                             f"(known: {', '.join(known)})")
        return values

    return parse


def positive_ints(text: str) -> list[int]:
    """An argparse ``type``: comma-separated positive integers (``48K``: 49152)."""
    values = list(int_list(text))
    if min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


# --------------------------------------------------------------------------------------------- planning


def plan_steps(builder: Builder, batches: Sequence[Sequence[int]], cost_model: CostModel, base: PlannerConfig,
               budget_gb: float) -> list[PlannedStep] | None:
    """The plans ``builder``'s run makes for ``batches`` at ``budget_gb``, or None if it cannot run there:
    its start-up check fails (``training.planning.check_memory_budget``: a full batch of ``--seq-length``
    documents must be plannable) or a step cannot be planned."""
    config = builder.configure(dataclasses.replace(base, memory_budget_bytes=budget_gb * GIB))
    try:
        plan_batch([config.max_seq_len] * len(batches[0]), cost_model, config)
        return [plan_batch(list(b), cost_model, config) for b in batches]
    except PlanInfeasible:
        return None


def recomputed(plans: Sequence[PlannedStep] | None) -> list[int] | None:
    return None if plans is None else [p.plan.recomputed_layers() for p in plans]


def smallest_budget(ok: Callable[[float], bool], what: str) -> tuple[float, float]:
    """The smallest budget on the :data:`GRID_GB` grid at which ``ok`` holds (bisection: ``ok`` is
    monotone in the budget for these conditions in practice; the result is checked by the caller),
    and the grid point below it."""
    hi = 64
    while not ok(hi * GRID_GB):
        hi *= 2
        if hi * GRID_GB > MAX_BUDGET_GB:
            fail(f"no budget up to {MAX_BUDGET_GB:.0f} GB per stage {what}")
    lo = 0  # a budget of 0 never holds anything
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid * GRID_GB) else (mid, hi)
    return hi * GRID_GB, lo * GRID_GB


def planned_batches(argv: list[str], steps: int, world_size: int = 2):
    """The lengths of the run's first ``steps`` global batches (its own sampler) on ``world_size``
    processes (data-parallel rank 0's), the run's planner config and cost model (as
    ``training.replay.reconstruct_plans`` rebuilds them)."""
    from megatron_epp.training.replay import parsed_config
    from megatron_epp.config.parser import ArgumentError
    from megatron_epp.training.planning import elastic_sampler, online_planner

    try:
        cfg = parsed_config([*argv, "--epp-memory-budget", "1"], world_size)  # the budget is the builders' to vary
    except ArgumentError as error:
        fail(f"the runs' flags would be refused: {str(error).removeprefix('pretrain_gpt.py: error: ')}")
    build = online_planner(cfg)
    stream = elastic_sampler(cfg, "train", cfg.parallel.dims.dp, build).iterate(0)
    batches = []
    for _ in range(steps):
        batch = next(stream)
        batches.append(batch.seq_lengths[batch.positions(0)].tolist())
    return batches, build


def all_plans(specs: Sequence[Builder], batches, cost_model: CostModel, base: PlannerConfig, budget_gb: float) -> dict[Builder, list[PlannedStep] | None]:
    return {s: plan_steps(s, batches, cost_model, base, budget_gb) for s in specs}


def plan_shape(plan: Plan) -> tuple:
    """What a plan runs (chunks, pipelines, recompute), without its statistics."""
    return tuple((tuple((c.kind, tuple((s.seq, s.start, s.length) for s in c.segments)) for c in p.chunks),
                  tuple(map(tuple, p.recompute))) for p in plan.pipelines)


def unbound_epp_plans(batches, cost_model: CostModel, base: PlannerConfig, from_gb: float) -> tuple[float, list[PlannedStep]]:
    """EPP's plans at a budget where memory shapes none of them (``from_gb`` doubled until doubling it again
    changes no plan), and that budget: what EPP would plan with no memory limit at all."""
    budget = from_gb
    plans = plan_steps(ELASTIC, batches, cost_model, base, budget)
    while True:
        more = plan_steps(ELASTIC, batches, cost_model, base, budget * 2)
        if plans is not None and more is not None and [plan_shape(p.plan) for p in plans] == [plan_shape(p.plan) for p in more]:
            return budget, plans
        budget, plans = budget * 2, more
        if budget > MAX_BUDGET_GB:
            fail(f"EPP's plans still change with the budget at {MAX_BUDGET_GB:.0f} GB per stage")


@dataclass
class BudgetChoice:
    """The budget of a data set and the facts that justify it (recomputed layers per step, None: cannot run)."""

    budget_gb: float
    chosen: str  # how it was chosen
    plans: dict[Builder, list[PlannedStep] | None]  # every builder's plans at budget_gb, per step (None: cannot run)
    below_gb: float | None = None  # the grid point below the chosen budget (searched budgets only)
    recompute_below: dict[str, list[int] | None] | None = None
    # where memory binds: EPP's plans at a budget where memory shapes none of them, and that budget (the ceiling)
    unbound: tuple[float, list[PlannedStep]] | None = None

    @property
    def recompute(self) -> dict[str, list[int] | None]:
        return {b.name: recomputed(p) for b, p in self.plans.items()}

    def lines(self, binds: bool) -> list[str]:
        out = [f"budget {self.budget_gb:.4f} GB per stage ({self.chosen})"]
        if self.below_gb is not None:
            below = ", ".join(f"{b} {fmt_layers(r)}" for b, r in self.recompute_below.items())
            out.append(f"  at {self.below_gb:.4f} GB (one grid step below) recomputed layers per step: {below}")
        out.append("  at the budget, recomputed layers per step: "
                   + ", ".join(f"{b} {fmt_layers(r)}" for b, r in self.recompute.items()))
        epp, meg = self.recompute.get(ELASTIC.name), self.recompute.get(MEGATRON.name)
        if binds:
            out.append(f"  EPP needs no recompute: {'yes' if epp is not None and not any(epp) else 'NO'}; Megatron packing "
                       f"recomputes on {sum(1 for r in meg or [] if r)} of {len(meg or [])} steps (warm-up included)"
                       + ("" if meg and any(meg) else " -- memory does NOT bind for Megatron here"))
        else:
            anything = [b for b, r in self.recompute.items() if r is None or any(r)]
            out.append("  nothing recomputes for any builder: " + ("yes" if not anything else f"NO ({', '.join(anything)})"))
        return out


def fmt_layers(r: list[int] | None) -> str:
    return "cannot run" if r is None else "[" + ",".join(map(str, r)) + "]"


def show(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


# --------------------------------------------------------------------------------------------- statistics


def step_matrix(runs: Sequence[Sequence[StepMetrics]], value: Callable[[StepMetrics], float]) -> np.ndarray:
    """``(repeat, step)`` values of the measured steps of every repeat (cut to the shortest run)."""
    n = min(len(r) for r in runs)
    return np.array([[value(s) for s in r[:n]] for r in runs], dtype=float)


def pipe_ms(s: StepMetrics) -> float:
    return s.elastic.measured_ms


def step_ratios(base: np.ndarray, epp: np.ndarray) -> np.ndarray:
    """Per step, baseline step time / EPP step time, a step's time being its median over repeats
    (both ``(repeat, step)``, cut to the common steps)."""
    n = min(base.shape[1], epp.shape[1])
    return np.median(base[:, :n], 0) / np.median(epp[:, :n], 0)


def paired_ratio(base: np.ndarray, epp: np.ndarray) -> float:
    """The reported ratio: the median over steps of :func:`step_ratios`."""
    return float(np.median(step_ratios(base, epp)))


def noise_floor(epp: np.ndarray) -> float | None:
    """Median over steps and pairs of repeats of ``|t_r / t_r' - 1|`` (EPP against itself); None with one repeat."""
    pairs = list(itertools.combinations(range(epp.shape[0]), 2))
    if not pairs:
        return None
    return float(np.median([abs(epp[r, i] / epp[q, i] - 1) for r, q in pairs for i in range(epp.shape[1])]))


def hindsight(rows: list[list[float]]) -> np.ndarray:
    """The errors left with the one factor on the predictions that fits these steps best (median ratio)."""
    ratio = np.array([1 + r[1] for r in rows])
    return ratio / np.median(ratio) - 1


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


# --------------------------------------------------------------------------------------------- data


def wiki_lengths(cap: int, gbs: int, steps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Training lengths, by document index, of ``steps`` global batches of ``gbs`` documents drawn from
    the Wikipedia sample, each batch scaled by cap / (its longest drawn length); and those scales.
    Document ``i`` is placed where ``pretrain_gpt.py``'s sampler (seed ``seed``) takes it for its batch."""
    from megatron_epp.data.mock_documents import WIKIPEDIA_LENGTHS, MockDocuments, lengths_from_file
    from megatron_epp.data.sequence_sampler import SequenceSampler

    if not Path(WIKIPEDIA_LENGTHS).is_file():
        fail(f"{WIKIPEDIA_LENGTHS} not found (set EPP_SHARED_DIR to the directory holding datasets/)")
    n = gbs * steps
    raw = lengths_from_file(WIKIPEDIA_LENGTHS, n, seed).reshape(steps, gbs)
    scales = cap / raw.max(axis=1)
    scaled = np.clip(np.rint(raw * scales[:, None]), 1, cap).astype(np.int64)
    # the run's sampler takes its batches in a seeded order: it gives the same order for any n trainable documents
    order = SequenceSampler(MockDocuments(np.full(n, 2), 257), gbs, cap, seed=seed).stream(0, n)
    lengths = np.empty(n, dtype=np.int64)
    lengths[order] = scaled.ravel()
    return lengths, scales


def wiki_dataset(cap: int, gbs: int, steps: int, seed: int) -> str:
    """An indexed dataset of random-byte documents with :func:`wiki_lengths` (cached under ``data_cache/bench``)."""
    prefix = REPO / "data_cache" / "bench" / f"wiki_per_step_{cap}_{gbs}x{steps}_{seed}"
    return byte_dataset(prefix, lambda: wiki_lengths(cap, gbs, steps, seed)[0], seed)


def byte_dataset(prefix: Path, lengths: Callable[[], Sequence[int]], seed: int) -> str:
    """The indexed dataset ``prefix`` (``.bin``/``.idx``) of random-byte documents, one of ``n`` + 1 tokens (``n``
    trained positions, the labels shifted) per ``n`` of ``lengths()``, written unless it is there already."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    if not Path(get_idx_path(str(prefix))).exists():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed)
        builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=DType.optimal_dtype(257))
        for n in lengths():
            ids = rng.integers(0, 256, size=int(n) + 1, dtype=np.int64)
            builder.add_document(ids, [ids.size])
        builder.finalize(get_idx_path(str(prefix)))
    return str(prefix)


def cp_run_argv(args, cp: int, pp: int = 1) -> list[str]:
    """``pretrain_gpt.py`` flags of the cp ``cp`` run of ``bench_context_parallel.py`` (also
    ``bench_planning_placement.py``'s ``cp2`` configuration, and at ``pp`` 2 ``bench_offload.py``'s runs), without the
    budget."""
    data = wiki_dataset(args.seq_length, args.global_batch_size, args.iters, args.seed)
    context = ["--context-parallel-size", str(cp), "--cp-comm-type", "a2a"] if cp > 1 else []
    return ["--elastic-pp", "--data-path", data, "--tokenizer-type", "ByteTokenizer", "--split", "1,0,0",
            "--pipeline-model-parallel-size", str(pp), *context, "--num-layers", str(args.num_layers),
            "--hidden-size", str(args.hidden_size), "--num-attention-heads", str(args.num_attention_heads),
            "--seq-length", str(args.seq_length), "--global-batch-size", str(args.global_batch_size),
            "--seed", str(args.seed), "--lr", "3e-3", "--train-iters", str(args.iters), "--log-interval", "1",
            *(["--epp-plan-between-steps"] if args.epp_plan_between_steps else [])]


def length_pool(name: str, seed: int = 0, n: int = 200_000) -> np.ndarray:
    """The length distributions (seeded; ``n`` documents to sample batches from):

    * ``commoncrawl``: log-normal, median 1,000 tokens, sigma 1.2 (mean ~2.1K, p99 ~16K): web text,
      mostly short, a light tail;
    * ``github``: log-normal, median 2,000, sigma 1.6 (mean ~7K, p99 ~83K): 16 % of the tokens in
      documents over 128K, ByteScale's figure for GitHub;
    * ``code-heavy`` (held out: not one the paper shows): log-normal, median 6,000, sigma 1.63, so
      that p99 ~264K, cut at 772K (the longest document of the held-out set);
    * ``wikipedia``: the shared sample of 1M real Wikipedia lengths (FlexSP's), if present.
    """
    rng = np.random.default_rng(seed)
    if name == "commoncrawl":
        x = rng.lognormal(np.log(1000), 1.2, n)
    elif name == "github":
        x = rng.lognormal(np.log(2000), 1.6, n)
    elif name == "code-heavy":
        x = np.minimum(rng.lognormal(np.log(6000), 1.63, n), 772_000)
    elif name == "wikipedia":
        return read_lengths(WIKIPEDIA_LENGTHS)
    else:
        fail(f"unknown data {name!r} (known: {', '.join(LENGTH_POOLS)})")
    return np.maximum(x, 16).astype(np.int64)


def batch(pool: np.ndarray, gbs: int, cap: int, seed: int) -> np.ndarray:
    return np.minimum(np.random.default_rng(seed).choice(pool, gbs, replace=False), cap)
