#!/usr/bin/env python3
"""EPP against Megatron packing and Seq1F1B on one GPU, a LLaMA-like layer, where memory binds.

Each cell (data, context cap) trains the same batches under four runs of ``pretrain_gpt.py --elastic-pp``
(torchrun, one process, pp=1, bf16, the flags' defaults otherwise: attention kernel, cost profile and the
rest are what a user gets):

* ``megatron`` (``--epp-plan megatron``), ``seq1f1b`` (``--epp-plan seq1f1b``, its default k) and ``epp``
  (``--epp-plan elastic``) at the cell's binding budget;
* ``epp_unlimited``: EPP at a budget where memory shapes none of its plans, its ceiling (a budget can
  only take plans away).

Model: ``--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --swiglu --ffn-hidden-size 11008 --normalization RMSNorm --disable-bias-linear``;
``--global-batch-size`` = 262144 / cap (16 documents at 16K, 8 at 32K). Data (``--cells DATA:CAP,...``):

* ``mock``: ``--mock-data`` (pretrain_gpt's skewed mock documents);
* ``wiki``: random-byte documents with lengths drawn from ``wikipedia_lengths.txt.gz``, each step's scaled
  so that its longest reaches the cap (``benchmarks/bench_elastic.py``'s ``wiki_dataset``);
* ``stdlib``: the Python standard library's sources in byte tokens, truncated at the cap.

Budget (``--epp-memory-budget``, GB per GPU as the planner counts it: model states + activations), derived
per cell in-process from the run's own batches, cost model and planner (as ``bench_elastic.py`` does): the
model states plus half the activation memory Megatron packing's plans need without recompute (their largest
predicted peak over the steps), on a 1/1024 GB grid, raised to where every builder can run if it is below
that; printed with every builder's recomputed layers per step. Half, so that memory binds: Megatron packing
must recompute on its largest step at least, and EPP's plans differ from its ceiling's (printed). The
ceiling's budget: that one doubled until doubling it again changes no EPP plan (``bench_elastic.py``'s).

Measurement: one warm-up step (dropped) and ``--iters`` (3) measured steps per run; steps are paired by
iteration (same documents under every builder: each run's tokens per step are checked against the planned
batches). Per run: ``step_ms`` the median iteration ms, ``tflops`` the median ``--log-throughput`` TFLOP/s
per GPU, ``peak_gb`` the model states (the planner's count) plus the largest activation peak the CUDA
allocator measured above a step's start (GiB). ``epp_vs_megatron``: the median over steps of Megatron's
step ms / EPP's (> 1: EPP faster); ``epp_vs_ceiling``: the median of EPP-unlimited's / EPP's (<= 1: the
share of its ceiling's speed EPP reaches under the budget); ``epp_vs_seq1f1b`` likewise; ``steps_ms`` and the
``*_steps`` lists: every measured step's ms and paired ratio, for the spread. The last line is one JSON object::

    {"device": ..., "cells": [{"data": ..., "cap": ..., "budget_gb": ..., "megatron": {"tflops": ..., "step_ms": ...,
     "peak_gb": ..., "steps_ms": [...]}, "seq1f1b": {...}, "epp": {...}, "epp_unlimited": {...}, "epp_vs_megatron": r,
     "epp_vs_ceiling": r, "epp_vs_seq1f1b": r, "epp_vs_megatron_steps": [...], "epp_vs_seq1f1b_steps": [...]}]}

(a run that failed: its numbers null and its ``error``; ratios null where a side is missing). The same line
is printed after each cell with the cells so far, so a run cut short keeps the cells it finished.

Duration: the default three cells take about 7.5 minutes on one H100, estimated (not timed end to end) as
:data:`START_S` per run plus each step's tokens at the evidence's rates (:data:`TOKENS_PER_S`); that
assumes the attention kernel torch picks by default is a fast one. ``--dry-run`` prints the cells, the
budgets, the commands and the estimate, with no GPU.

``--runs megatron,epp`` runs a subset (ratios whose sides did not run are null); ``--model-flags "..."`` trains another
model (pretrain_gpt.py's model flags, ``--seq-length`` among them fixing the cells' cap): ``gpu_check.sh --quick``
benches its training run's model and cap, whose start-up profile that run left in the cache.

    python -m benchmarks.bench_gpu [--cells mock:32768,wiki:16384,stdlib:32768 | --all] [--iters 3] [--runs LIST]
                                [--model-flags "..."] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np



from megatron_epp.base.units import GIB
from megatron_epp.plan import PlannedStep
from megatron_epp.planner.builders import ELASTIC, MEGATRON, SEQ1F1B
from megatron_epp.training.metrics import StepMetrics
from benchmarks.common import Parser, BudgetChoice, GRID_GB, MAX_BUDGET_GB, all_plans, fmt_layers, plan_steps, planned_batches, recomputed, show, smallest_budget, unbound_epp_plans, fail, wiki_dataset

LLAMA = ["--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention",
         "--num-query-groups", "8", "--swiglu", "--ffn-hidden-size", "11008", "--normalization", "RMSNorm", "--disable-bias-linear"]
DATA = ("mock", "wiki", "stdlib")
CAPS = (16384, 32768)
DEFAULT_CELLS = "mock:32768,wiki:16384,stdlib:32768"
TOKENS_PER_BATCH = 262144  # --global-batch-size = this / cap
# the runs of a cell, each a builder at the cell's budget (epp_unlimited: at its ceiling's)
RUNS = {"megatron": MEGATRON, "seq1f1b": SEQ1F1B, "epp": ELASTIC, "epp_unlimited": ELASTIC}
# The time estimate (dry run and start line). From the 2026-11-25 H100 evidence (shared/gpu-evidence/2026-11-25-h100):
# gpu_check's train step took 140 s for 115 s of iterations (start-up ~25 s per run); this model trained at ~30K tokens/s
# under Megatron packing and EPP and ~15K under Seq1F1B k=8 (nocudnn_l16_*, nocudnn_l32_*, wikilengths_*; SDPA on flash),
# the first step at half that.
START_S = 25.0
TOKENS_PER_S = {"megatron": 30000.0, "seq1f1b": 15000.0, "elastic": 30000.0}
WARMUP_SLOWDOWN = 2.0
BIND_FRACTION = 0.5  # the binding budget: model states + this share of Megatron packing's activation need



@dataclass(frozen=True)
class Cell:
    data: str
    cap: int

    @property
    def global_batch_size(self) -> int:
        return max(TOKENS_PER_BATCH // self.cap, 1)

    @property
    def name(self) -> str:
        return f"{self.data}@{self.cap // 1024}K"


def parse_cells(text: str) -> list[Cell]:
    cells = []
    for item in filter(None, text.split(",")):
        data, _, cap = item.partition(":")
        if data not in DATA or not cap.isdigit() or int(cap) < 128:
            fail(f"--cells: {item!r}: expected DATA:CAP with DATA one of {', '.join(DATA)} and CAP tokens (>= 128)")
        cells.append(Cell(data, int(cap)))
    if not cells:
        fail("--cells: no cell")
    return cells


def cell_argv(cell: Cell, iters: int, seed: int, model: Sequence[str] = LLAMA) -> list[str]:
    """``pretrain_gpt.py`` flags of ``cell`` for ``model`` (its flags), without budget and builder (a wiki cell writes its
    dataset)."""
    steps = iters + 1
    if cell.data == "mock":
        data = ["--mock-data"]
    elif cell.data == "wiki":
        data = ["--data-path", wiki_dataset(cell.cap, cell.global_batch_size, steps, seed), "--tokenizer-type", "ByteTokenizer",
                "--split", "1,0,0"]
    else:
        from megatron_epp.data.stdlib_corpus import ensure_stdlib_corpus

        data = ["--data-path", ensure_stdlib_corpus(progress=False), "--epp-truncate-documents", "--tokenizer-type", "ByteTokenizer",
                "--split", "1,0,0"]
    return ["--elastic-pp", "--bf16", "--pipeline-model-parallel-size", "1", *model, *data, "--seq-length", str(cell.cap),
            "--global-batch-size", str(cell.global_batch_size), "--train-iters", str(steps), "--lr", "3e-4", "--log-interval", "1",
            "--log-throughput", "--seed", str(seed)]


@dataclass
class Prepared:
    """A cell ready to run: its flags, batches (planned in-process), budgets and every run's plans."""

    cell: Cell
    argv: list[str]
    batches: list[list[int]]
    choice: "BudgetChoice"
    unlimited_gb: float
    unlimited_plans: list[PlannedStep]
    model_state_bytes: float
    planning_s: float

    def budget(self, run: str) -> float:
        return self.unlimited_gb if run == "epp_unlimited" else self.choice.budget_gb

    def command(self, run: str) -> list[str]:
        return [*self.argv, "--epp-memory-budget", repr(self.budget(run)), *RUNS[run].flags()]

    def plans(self, run: str) -> list[PlannedStep] | None:
        return self.unlimited_plans if run == "epp_unlimited" else self.choice.plans[RUNS[run]]

    def estimate_s(self, run: str) -> float:
        tokens = [sum(b) for b in self.batches]
        rate = TOKENS_PER_S[RUNS[run].name]
        return START_S + (WARMUP_SLOWDOWN * tokens[0] + sum(tokens[1:])) / rate


def prepare(cell: Cell, args) -> Prepared:
    t0 = time.perf_counter()
    argv = cell_argv(cell, args.iters, args.seed, args.model_flags)
    batches, build = planned_batches(argv, args.iters + 1, world_size=1)
    if cell.data == "wiki" and any(max(b) != cell.cap for b in batches):
        fail(f"{cell.name}: the wiki batches are not the ones written (each step's longest should be the cap)")
    specs = [RUNS["megatron"], RUNS["seq1f1b"], RUNS["epp"]]
    cm, base = build.cost_model, build.config
    if args.epp_memory_budget is not None:
        choice = BudgetChoice(args.epp_memory_budget, "given", all_plans(specs, batches, cm, base, args.epp_memory_budget))
    else:
        choice = binding_budget(specs, batches, cm, base)
    unlimited_gb, unlimited_plans = unbound_epp_plans(batches, cm, base, choice.budget_gb)
    return Prepared(cell, argv, batches, choice, unlimited_gb, unlimited_plans, float(cm.model_state_bytes()[0]), time.perf_counter() - t0)


def binding_budget(specs, batches, cost_model, base, fraction: float = BIND_FRACTION) -> "BudgetChoice":
    """Model states + ``fraction`` of the activation memory Megatron packing's plans need without recompute (their
    largest predicted peak over the steps), rounded up to the grid; raised to the smallest grid budget where every
    builder can run if it is below that."""
    free = plan_steps(RUNS["megatron"], batches, cost_model, base, MAX_BUDGET_GB)
    if free is None:
        fail("Megatron packing cannot plan these batches at any budget")
    states = float(cost_model.model_state_bytes()[0]) / GIB
    need = max(max(p.report.peak_memory_bytes) for p in free) / GIB
    target = math.ceil((states + fraction * (need - states)) / GRID_GB) * GRID_GB
    how = f"model states {states:.2f} GB + {fraction:g} x the {need - states:.2f} GB of activations Megatron packing's plans need without recompute"
    plans = all_plans(specs, batches, cost_model, base, target)
    if all(p is not None for p in plans.values()):
        return BudgetChoice(target, how, plans)
    budget, _ = smallest_budget(
        lambda b: b >= target and all(plan_steps(s, batches, cost_model, base, b) is not None for s in specs),
        "lets every builder plan these batches")
    return BudgetChoice(budget, f"{how}, raised to where every builder can run", all_plans(specs, batches, cost_model, base, budget))


def describe(p: Prepared) -> list[str]:
    lengths = np.concatenate(p.batches)
    out = [f"== {p.cell.name}: {p.cell.global_batch_size} documents per step, tokens per step {[int(sum(b)) for b in p.batches]} "
           f"(first: warm-up), lengths p50 {np.median(lengths):.0f} p90 {np.percentile(lengths, 90):.0f} max {lengths.max()}; "
           f"model states {p.model_state_bytes / GIB:.2f} GB (planner)"]
    out += ["  " + line for line in p.choice.lines(True)]
    out.append(f"  ceiling (epp_unlimited): {p.unlimited_gb:.4f} GB, EPP's plans recompute "
               f"{fmt_layers(recomputed(p.unlimited_plans))} layers per step (memory shapes none of them)")
    return out


# ------------------------------------------------------------------------------------------ statistics
def run_entry(steps: Sequence[StepMetrics] | str, model_state_bytes: float) -> dict:
    """One run's numbers over its measured steps (``steps``; a string: why it did not run)."""
    if isinstance(steps, str):
        return {"tflops": None, "step_ms": None, "peak_gb": None, "error": steps}
    tflops = [s.tflops_per_gpu for s in steps if s.tflops_per_gpu is not None]
    activation = max(max(s.elastic.measured_activation_bytes or [0]) for s in steps)
    return {"tflops": statistics.median(tflops) if tflops else None, "step_ms": statistics.median(s.iter_ms for s in steps),
            "peak_gb": (model_state_bytes + activation) / GIB, "steps_ms": [s.iter_ms for s in steps]}


def paired_ratios(base: Sequence[StepMetrics] | str, epp: Sequence[StepMetrics] | str) -> list[float]:
    """Per iteration both ran, ``base``'s iteration ms / ``epp``'s (empty if either did not run)."""
    if isinstance(base, str) or isinstance(epp, str):
        return []
    by_iteration = {s.iteration: s.iter_ms for s in epp}
    return [s.iter_ms / by_iteration[s.iteration] for s in base if s.iteration in by_iteration]


def paired_ratio(base: Sequence[StepMetrics] | str, epp: Sequence[StepMetrics] | str) -> float | None:
    """Median of :func:`paired_ratios` (None if either did not run)."""
    ratios = paired_ratios(base, epp)
    return statistics.median(ratios) if ratios else None


def cell_entry(cell: Cell, budget_gb: float, measured: dict[str, Sequence[StepMetrics] | str], model_state_bytes: float) -> dict:
    """The JSON entry of a cell from its runs' measured steps (warm-up dropped; a string: why a run failed)."""
    entry: dict = {"data": cell.data, "cap": cell.cap, "budget_gb": budget_gb}
    for run in RUNS:
        entry[run] = run_entry(measured.get(run, "not run (--runs)"), model_state_bytes)
    entry["epp_vs_megatron"] = paired_ratio(measured.get("megatron", ""), measured.get("epp", ""))
    entry["epp_vs_ceiling"] = paired_ratio(measured.get("epp_unlimited", ""), measured.get("epp", ""))
    entry["epp_vs_seq1f1b"] = paired_ratio(measured.get("seq1f1b", ""), measured.get("epp", ""))
    for base in ("megatron", "seq1f1b"):  # per step, to read the spread beside the median
        entry[f"epp_vs_{base}_steps"] = paired_ratios(measured.get(base, ""), measured.get("epp", ""))
    return entry


def report_lines(p: Prepared, measured: dict[str, Sequence[StepMetrics] | str], entry: dict) -> list[str]:
    out = [f"== {p.cell.name} at {p.choice.budget_gb:.4f} GB (epp_unlimited at {p.unlimited_gb:.4f} GB)"]
    for run in RUNS:
        steps, e = measured.get(run, "not run (--runs)"), entry[run]
        if isinstance(steps, str):
            out.append(f"  {run:14s} did not run: {steps}")
            continue
        plans = ", ".join(s.elastic.plan.split(" ", 1)[0] + f" chunks={sum(s.elastic.num_chunks.values())} recompute={s.elastic.recomputed_layers}"
                          for s in steps)
        tflops = "n/a" if e["tflops"] is None else f"{e['tflops']:.0f}"
        over = " (over the budget)" if e["peak_gb"] > p.budget(run) else ""
        out.append(f"  {run:14s} step ms {e['step_ms']:.0f}, TFLOP/s {tflops}, peak {e['peak_gb']:.1f} GB{over} | {plans}")
    out.append("  EPP vs Megatron " + show(entry["epp_vs_megatron"]) + ", vs Seq1F1B " + show(entry["epp_vs_seq1f1b"])
               + " (baseline step ms / EPP's, > 1: EPP faster); EPP reaches " + show(entry["epp_vs_ceiling"])
               + " of its ceiling's speed")
    return out


# ------------------------------------------------------------------------------------------ running
def gpu_name() -> str | None:
    """The GPU's name from a separate process (this one keeps no CUDA context while the runs train), None without CUDA."""
    probe = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    name = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    return name or None


def measure(p: Prepared, args) -> dict[str, list[StepMetrics] | str]:
    """Every run of a cell: its measured steps (warm-up dropped), or why it failed."""
    from megatron_epp.training.replay import run_pretrain

    expected = [int(sum(b)) for b in p.batches]
    measured: dict[str, list[StepMetrics] | str] = {}
    for run in args.runs:
        t0 = time.perf_counter()
        if p.plans(run) is None:
            measured[run] = "cannot run at this budget (planned in-process)"
        else:
            try:
                steps = run_pretrain(p.command(run), nproc=1, timeout=args.run_timeout)
                tokens = [int(s.tokens) for s in steps]
                measured[run] = steps[1:] if tokens == expected else f"tokens per step {tokens} differ from the planned batches' {expected}"
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                measured[run] = str(error).splitlines()[0][:300]
        ok = "" if not isinstance(measured[run], str) else f" FAILED: {measured[run]}"
        print(f"  [{p.cell.name}] {run:14s} {time.perf_counter() - t0:5.1f} s{ok}", flush=True)
    return measured


def model_flags(text: str | None) -> tuple[list[str], int | None]:
    """``--model-flags``: the flags (default the LLaMA-like model's) and the ``--seq-length`` among them (None: none)."""
    if text is None:
        return LLAMA, None
    flags = text.split()
    if "--seq-length" not in flags:
        return flags, None
    i = flags.index("--seq-length")
    if i + 1 >= len(flags) or not flags[i + 1].isdigit():
        fail("--model-flags: --seq-length needs a number of tokens")
    return flags[:i] + flags[i + 2:], int(flags[i + 1])


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=DEFAULT_CELLS, help=f"DATA:CAP,... with DATA in {', '.join(DATA)} (default {DEFAULT_CELLS})")
    ap.add_argument("--all", action="store_true", help="every data set at caps 16K and 32K (6 cells, about twice the default's time)")
    ap.add_argument("--iters", type=int, default=3, help="measured steps per run after one warm-up step (default 3)")
    ap.add_argument("--epp-memory-budget", type=float, default=None, help="GB per GPU for every cell (default: derived per cell)")
    ap.add_argument("--seed", type=int, default=1234, help="data order, mock and wiki documents (default 1234)")
    ap.add_argument("--run-timeout", type=float, default=300.0, help="seconds per pretrain_gpt.py run (default 300)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"which runs of each cell (default all: {','.join(RUNS)})")
    ap.add_argument("--model-flags", default=None, help="pretrain_gpt.py's model flags in place of the LLaMA-like 8-layer model's "
                    "(a --seq-length among them is every cell's cap)")
    ap.add_argument("--dry-run", action="store_true", help="print the cells, budgets, commands and estimated time; train nothing")
    args = ap.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    if not args.runs or any(r not in RUNS for r in args.runs):
        fail(f"--runs {','.join(args.runs)}: expected a comma-separated subset of {', '.join(RUNS)}")
    args.model_flags, cap = model_flags(args.model_flags)
    args.cells = [Cell(d, c) for c in CAPS for d in DATA] if args.all else parse_cells(args.cells)
    if cap is not None:
        args.cells = [Cell(c.data, cap) for c in args.cells]
    if args.iters < 1:
        fail("--iters must be >= 1")
    if args.epp_memory_budget is not None and args.epp_memory_budget <= 0:
        fail("--epp-memory-budget must be positive")
    if args.run_timeout <= 0:
        fail("--run-timeout must be positive")
    if any(c.data == "wiki" for c in args.cells):
        from megatron_epp.data.mock_documents import WIKIPEDIA_LENGTHS

        if not Path(WIKIPEDIA_LENGTHS).is_file():
            fail(f"{WIKIPEDIA_LENGTHS} not found (set EPP_SHARED_DIR to the directory holding datasets/)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    device = None
    if not args.dry_run:
        device = gpu_name()
        if device is None:
            fail("no CUDA device (torch.cuda.is_available() is False); --dry-run shows what would run")
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    print(f"bench_gpu: {len(args.cells)} cell(s) {', '.join(c.name for c in args.cells)}; runs {', '.join(args.runs)}; 1 warm-up + "
          f"{args.iters} measured steps each; " + (f"on {device}" if device else "dry run (budgets planned on this machine's "
                                                   "default profile, as a run here would)"), flush=True)
    prepared = [prepare(cell, args) for cell in args.cells]
    estimate = sum(p.estimate_s(run) + p.planning_s / len(args.runs) for p in prepared for run in args.runs)
    for p in prepared:
        print("\n".join(describe(p)))
        for run in args.runs:
            print(f"  {run:14s} (~{p.estimate_s(run):.0f} s) python3 -m torch.distributed.run --nproc-per-node 1 pretrain_gpt.py "
                  + " ".join(p.command(run)) + " --epp-metrics <file>")
    print(f"\nestimated time on one H100: {estimate / 60:.1f} min ({len(prepared) * len(args.runs)} runs of ~{START_S:.0f} s start-up plus "
          f"their steps at ~{TOKENS_PER_S['megatron'] / 1000:.0f}K tokens/s, Seq1F1B ~{TOKENS_PER_S['seq1f1b'] / 1000:.0f}K; planning "
          f"{sum(p.planning_s for p in prepared):.0f} s)", flush=True)
    if args.dry_run:
        return
    t0 = time.perf_counter()
    cells = []
    for p in prepared:
        measured = measure(p, args)
        entry = cell_entry(p.cell, p.choice.budget_gb, measured, p.model_state_bytes)
        print("\n".join(report_lines(p, measured, entry)), flush=True)
        cells.append(entry)
        print(json.dumps({"device": device, "cells": cells}), flush=True)  # the cells so far
    print(f"\n{time.perf_counter() - t0:.0f} s of runs")
    print(json.dumps({"device": device, "cells": cells}))


if __name__ == "__main__":
    main()
