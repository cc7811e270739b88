#!/usr/bin/env python3
"""EPP against Megatron packing and Seq1F1B in the regime EPP is for: long, skewed documents where memory binds.

Every builder runs as its users run it, through ``pretrain_gpt.py --elastic-pp`` under torchrun at pp=2
(CPU/gloo, one rank per core, ``OMP_NUM_THREADS=1``); model 4 layers (2 per stage), hidden 128, 4 heads,
FFN 512, byte tokens (vocabulary 257); context cap ``--seq-length`` 8192:

* ``megatron`` (``--epp-plan megatron``): whole documents packed into ``--seq-length``-token
  micro-batches, one 1F1B pipeline, the same number of recomputed layers for every micro-batch, as
  many as the budget needs;
* ``seq1f1b`` (``--epp-plan seq1f1b --epp-max-slices k``), ``k`` fixed per run, each of ``--seq1f1b-k``
  (default 2, 4, 8) in the first repeat; its best ``k`` (lowest ratio to EPP in that repeat) is the one
  reported and the only one run in later repeats (all three in every repeat would add a third to the time);
* ``elastic`` (``--epp-plan elastic``): EPP's planner, adaptive per-chunk recompute.

Data sets; step ``i`` trains the same documents under every builder and repeat (same data, same seed),
checked by every run's tokens per step against the batches the script planned in-process:

* ``stdlib``: the Python standard library's sources (``ensure_stdlib_corpus``, byte tokens), 2 files per
  step, files longer than the cap trained on their first ``--seq-length`` tokens
  (``--epp-truncate-documents``);
* ``wiki``: random-byte documents whose lengths are drawn (seeded, with replacement) from
  ``wikipedia_lengths.txt.gz``, 8 per step; each step's drawn pool is scaled by cap / (its longest
  length), so every step's longest document reaches the cap and the skew inside a step is Wikipedia's.
  Per step, not one scale for the whole run: with one scale only the run's one or two longest documents
  come near the cap, and memory would bind on one step in six (the per-step ratio's median would then
  measure steps where it does not). The scales are printed and in the JSON (``wiki_step_scales``);
* ``wiki-nobind``: the same batches as ``wiki`` at a budget where memory does not bind (below).

Memory budget (``--epp-memory-budget``, GB per stage: model states + activations, as the planner counts
it), chosen from the planner itself, in-process: the planner is deterministic and torch-free, the
batches come from the run's own sampler and are planned with the run's cost model and planner config,
as ``megatron_epp.training.replay.reconstruct_plans`` rebuilds them. For ``stdlib`` and ``wiki``: the
smallest budget on a 1/1024 GB grid (bisection) at which EPP's plans need no recompute on any step and
every builder passes ``pretrain_gpt.py``'s start-up check; printed with the recomputed layers per step of
every builder there and one grid step below (where EPP recomputes or cannot plan), and whether Megatron
packing recomputes there (memory binds for it on at least one step). For ``wiki-nobind``: the smallest
budget at which no builder recomputes on any step, doubled until doubling it again changes no EPP plan
(memory shapes no plan). ``--epp-memory-budget`` / ``--nobind-memory-budget`` override the choice; the
same facts are printed at the given value.

Measurement: ``--repeats`` (3) rounds per data set, builder order rotated by one per round to spread
drift; each run trains one warm-up step (dropped) and ``--iters`` (5) measured steps. A step's time is
the median over repeats of its pipeline ms (``measured ms`` of the log: ``forward_backward_elastic`` on
the last stage); ratio = baseline step time / EPP step time, per step, median over steps (> 1: EPP
faster). Noise floor: EPP against itself, the median over steps and over every pair of EPP's repeats of
``|t_r / t_r' - 1|`` (needs 2 repeats; a ratio within 1 +- noise is a tie). Per builder the report gives
the plan (chunks by kind, pipelines, recomputed layers per step), predicted (the planner's, in the
profiling machine's ms) vs measured pipeline ms, iteration ms, and the measured peak activation memory
per stage beside its prediction.

Simulated beside measured: the same ratios from the planner's predicted step times of the same plans
(rebuilt in-process, no torch), so that where a goal is missed the output shows whether the cost model
agrees. Goals, printed next to the figures, not tuned toward: where memory binds, EPP <= 0.60x
Megatron's step time (ratio >= 1.67) and <= 0.85x Seq1F1B's at its best k (ratio >= 1.18); where it
does not, EPP >= 0.97x the better baseline's speed (the smaller ratio >= 0.97) and no loss to packing
beyond noise.

The ceiling, where memory binds: a budget can only take plans away, so EPP under it is at best as fast as
EPP with no memory limit. The baselines' step times at the budget against EPP's plans at a budget where
memory shapes none of them (the binding budget doubled until doubling again changes no EPP plan) bound
every ratio EPP could reach there (Seq1F1B at its best k): simulated for every binding data set, and
measured for ``wiki`` when ``wiki-nobind`` (the same batches, a budget where memory does not bind) ran too.
A goal above its ceiling is printed as not reachable at this budget: what is missing is then not memory (the rest of EPP's step
against its compute bound is the pipeline's fill and drain and the per-chunk constants, which the
baselines pay too).

The last line is one JSON object: per data set ``{"megatron": r, "seq1f1b": r, "seq1f1b_k": k, "noise": n,
"budget_gb": b, "megatron_recompute_steps": m, "simulated": {"megatron": r, "seq1f1b": r, "seq1f1b_k": k,
"epp_over_bound": x, "ceiling": {"budget_gb": b, "megatron": r, "seq1f1b": r}}}`` (``ceiling`` where memory binds; ``wiki``
also ``"ceiling_measured": {"from": "wiki-nobind", "megatron": r, "seq1f1b": r}`` when both ran)
(null where a builder did not run) and ``"config"``. Duration on 2 idle cores, estimated from the
planner's predictions and this machine's measured layer speed (not timed end to end): about 20-25
minutes with the defaults (33 runs of ~14 s start-up plus their steps); ``--quick`` (1 repeat, 2 steps,
cap 2048, k = 4 only; 9 runs): about 3 minutes. ``--simulate-only``: budgets and simulated ratios, no
training (under a minute).

    python -m benchmarks.bench_elastic [--quick] [--simulate-only] [--datasets stdlib,wiki,wiki-nobind]
        [--repeats 3] [--iters 5] [--seq-length 8192] [--seq1f1b-k 2,4,8] [--epp-memory-budget GB]
        [--nobind-memory-budget GB]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable, Sequence

import numpy as np

from benchmarks.common import (BudgetChoice, Parser, all_plans, fail, fmt_layers, load_average, subset_of, noise_floor, paired_ratio, positive_ints,
                               pipe_ms, plan_steps, planned_batches, recomputed, show, smallest_budget, step_matrix,
                               step_ratios, unbound_epp_plans, wiki_dataset, wiki_lengths)
from megatron_epp.cost.model import CostModel
from megatron_epp.planner.builders import ELASTIC, MEGATRON, SEQ1F1B, Builder
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.training.metrics import StepMetrics

DATASETS = ("stdlib", "wiki", "wiki-nobind")
BINDS = {"stdlib": True, "wiki": True, "wiki-nobind": False}
# goals, as ratios baseline / EPP: EPP <= 0.60x Megatron and <= 0.85x Seq1F1B where memory binds
GOAL_BIND = {"megatron": 1 / 0.60, "seq1f1b": 1 / 0.85}
GOAL_NOBIND = 0.97  # EPP >= 0.97x the better baseline's speed: min(ratios) >= 0.97

EPP = ELASTIC


def builders(ks: Sequence[int]) -> list[Builder]:
    return [EPP, MEGATRON, *(SEQ1F1B.at(k) for k in ks)]


# --------------------------------------------------------------------------------------------- planning


def choose_bind_budget(specs: Sequence[Builder], batches, cost_model: CostModel, base: PlannerConfig) -> BudgetChoice:
    """Smallest grid budget at which EPP's plans need no recompute and every builder can run."""

    def ok(b: float) -> bool:
        epp = recomputed(plan_steps(EPP, batches, cost_model, base, b))
        return epp is not None and not any(epp) and all(plan_steps(s, batches, cost_model, base, b) is not None for s in specs)

    budget, below = smallest_budget(ok, "lets EPP plan these batches without recompute")
    return BudgetChoice(budget, "smallest at which EPP's plans need no recompute and every builder can run",
                        all_plans(specs, batches, cost_model, base, budget), below,
                        {b.name: recomputed(p) for b, p in all_plans(specs, batches, cost_model, base, below).items()})


def choose_nobind_budget(specs: Sequence[Builder], batches, cost_model: CostModel, base: PlannerConfig) -> BudgetChoice:
    """Smallest grid budget at which no builder recomputes, doubled until EPP's plans no longer change
    when it doubles again: memory then shapes no plan."""

    def ok(b: float) -> bool:
        return all((r := recomputed(plan_steps(s, batches, cost_model, base, b))) is not None and not any(r) for s in specs)

    budget, _ = smallest_budget(ok, "lets every builder plan without recompute")
    budget, _ = unbound_epp_plans(batches, cost_model, base, budget)
    return BudgetChoice(budget, "no builder recomputes and doubling it changes no EPP plan",
                        all_plans(specs, batches, cost_model, base, budget))


# --------------------------------------------------------------------------------------------- statistics


def first_repeat_best(measured: dict[Builder, list[list[StepMetrics]]]) -> Builder | None:
    """Seq1F1B's best k: the builder with the lowest ratio to EPP in the first repeat (where every k
    runs; later repeats run only this one), or None."""
    if not measured.get(EPP):
        return None
    epp = step_matrix(measured[EPP][:1], pipe_ms)
    ratios = {b: paired_ratio(step_matrix(runs[:1], pipe_ms), epp) for b, runs in measured.items() if b.family == SEQ1F1B and runs}
    return min(ratios, key=ratios.get) if ratios else None


def summarize(measured: dict[Builder, list[list[StepMetrics]]], predicted: dict[Builder, list[float]], choice: BudgetChoice) -> dict:
    """One data set's JSON entry: the measured ratios (null where a builder did not run; Seq1F1B at
    its best k, over all its repeats), the noise floor, the budget, on how many measured steps
    Megatron's plan recomputes, and the simulated ratios of the same plans (``predicted``: each
    builder's predicted ms per measured step; Seq1F1B at the k the simulator finds best)."""
    meg = choice.recompute.get("megatron")
    out: dict = {"megatron": None, "seq1f1b": None, "seq1f1b_k": None, "noise": None, "budget_gb": choice.budget_gb,
                 "megatron_recompute_steps": None if meg is None else sum(1 for r in meg[1:] if r)}
    if measured.get(EPP):
        epp = step_matrix(measured[EPP], pipe_ms)
        out["noise"] = noise_floor(epp)
        out["megatron"] = next((paired_ratio(step_matrix(r, pipe_ms), epp) for b, r in measured.items() if b == MEGATRON and r), None)
        best = first_repeat_best(measured)
        if best is not None:
            out["seq1f1b"], out["seq1f1b_k"] = paired_ratio(step_matrix(measured[best], pipe_ms), epp), best.k
    sim: dict = {"megatron": None, "seq1f1b": None, "seq1f1b_k": None, "epp_over_bound": None}
    if predicted.get(EPP):
        epp = np.array([predicted[EPP]])
        # EPP's predicted step over its compute-only bound (no bubble, recompute or per-chunk constants):
        # what any plan could still gain, median over the measured steps
        sim["epp_over_bound"] = float(np.median(epp[0] / [p.report.bound_step_ms for p in choice.plans[EPP][1:]]))
        ratios = {b: paired_ratio(np.array([p]), epp) for b, p in predicted.items() if b != EPP}
        sim["megatron"] = next((r for b, r in ratios.items() if b == MEGATRON), None)
        seq = {b.k: r for b, r in ratios.items() if b.family == SEQ1F1B}
        if seq:
            sim["seq1f1b_k"] = min(seq, key=seq.get)
            sim["seq1f1b"] = seq[sim["seq1f1b_k"]]
    if choice.unbound is not None and predicted:
        # the ceiling: the baselines here against EPP with no memory limit (a budget cannot make EPP faster)
        free = np.array([[p.report.predicted_step_ms for p in choice.unbound[1][1:]]])
        ceiling = {b: paired_ratio(np.array([p]), free) for b, p in predicted.items() if b != EPP}
        seq = [r for b, r in ceiling.items() if b.family == SEQ1F1B]
        sim["ceiling"] = {"budget_gb": choice.unbound[0], "megatron": next((r for b, r in ceiling.items() if b == MEGATRON), None),
                          "seq1f1b": min(seq) if seq else None}  # against its best k
    out["simulated"] = sim
    return out


def measured_ceilings(entries: dict, results: dict) -> None:
    """Where both ``wiki`` and ``wiki-nobind`` ran (the same batches): the measured ceiling of ``wiki``, its
    baselines' step times against EPP's at the budget where memory does not bind, per step, median over steps."""
    bind, free = results.get("wiki"), results.get("wiki-nobind")
    if bind is None or free is None or not bind[2].get(EPP) or not free[2].get(EPP):
        return
    epp_free = step_matrix(free[2][EPP], pipe_ms)
    entry = entries["wiki"]
    meg = next((runs for b, runs in bind[2].items() if b == MEGATRON and runs), None)
    seq = next((runs for b, runs in bind[2].items() if b.family == SEQ1F1B and b.k == entry["seq1f1b_k"] and runs), None)  # its best k
    entry["ceiling_measured"] = {"from": "wiki-nobind", "megatron": None if meg is None else paired_ratio(step_matrix(meg, pipe_ms), epp_free),
                                 "seq1f1b": None if seq is None else paired_ratio(step_matrix(seq, pipe_ms), epp_free)}


def goal_lines(entry: dict, binds: bool) -> list[str]:
    """The goals beside the measured and simulated ratios of one data set."""
    sim, noise = entry["simulated"], entry["noise"]
    ran = any(entry[k] is not None for k in GOAL_BIND)
    tie = "" if not ran else " (1 repeat: no noise floor)" if noise is None else f" (noise floor {noise:.3f})"
    if binds:
        out = []
        for key, goal in GOAL_BIND.items():
            k = f" (measured k={entry['seq1f1b_k']}, simulated k={sim['seq1f1b_k']})" if key == "seq1f1b" else ""
            met = "n/a" if entry[key] is None else ("met" if entry[key] >= goal else "NOT met")
            out.append(f"  {key:8s} measured {show(entry[key])}{tie}, simulated {show(sim[key])}{k} | goal >= {goal:.2f} "
                       f"(EPP <= {1 / goal:.2f}x its time): {met}")
        ceiling, measured_ceiling = sim.get("ceiling"), entry.get("ceiling_measured")
        if ceiling is not None:
            out.append(f"  ceiling: the baselines here against EPP with no memory limit (its plans at {ceiling['budget_gb']:.4f} GB, "
                       "where memory shapes none; a budget cannot make EPP faster than that)")
            for key, goal in GOAL_BIND.items():
                m = "" if measured_ceiling is None else f"measured {show(measured_ceiling[key])} (EPP of {measured_ceiling['from']}), "
                known = [c for c in (ceiling[key], None if measured_ceiling is None else measured_ceiling[key]) if c is not None]
                reach = ("n/a" if not known else "reachable" if max(known) >= goal else "NOT reachable at this budget"
                         + (" (but within the noise)" if noise is not None and max(known) >= goal * (1 - noise) else ""))
                out.append(f"    {key:8s} {m}simulated {show(ceiling[key])} | goal >= {goal:.2f}: {reach}")
        return out
    both, sim_both = [entry[k] for k in GOAL_BIND], [sim[k] for k in GOAL_BIND]
    worst = None if None in both else min(both)
    met = "n/a" if worst is None else ("met" if worst >= GOAL_NOBIND else "NOT met")
    out = [f"  better baseline measured {show(worst)}{tie}, simulated {show(None if None in sim_both else min(sim_both))} | "
           f"goal >= {GOAL_NOBIND:.2f} (EPP >= {GOAL_NOBIND:.2f}x its speed): {met}"]
    if entry["megatron"] is not None and noise is not None:
        lost = entry["megatron"] < 1 - noise
        out.append(f"  megatron measured {entry['megatron']:.2f}: " + ("EPP LOSES to packing beyond noise" if lost else "no loss to packing beyond noise"))
    return out


def builder_lines(b: Builder, runs: list[list[StepMetrics]], predicted: list[float] | None, epp: np.ndarray | None) -> list[str]:
    """One builder's plan, predicted vs measured ms, iteration ms, activation memory and per-step ratios."""
    first = runs[0]
    kinds = {k: np.median([s.elastic.num_chunks[k] for s in first]) for k in ("batched", "split", "hybrid")}
    pipe = step_matrix(runs, pipe_ms)
    iters = step_matrix(runs, lambda s: s.iter_ms)
    logged = np.median([s.elastic.predicted_step_ms for s in first])
    meas_mb = np.max([s.elastic.measured_activation_bytes for r in runs for s in r], axis=0) / 2**20
    pred_mb = np.max([s.elastic.predicted_activation_bytes for s in first], axis=0) / 2**20
    mem = ", ".join(f"{m:.1f}/{p:.1f}" for m, p in zip(meas_mb, pred_mb))
    ratios = "" if epp is None or b == EPP else " | per step vs EPP " + " ".join(f"{r:.2f}" for r in step_ratios(pipe, epp))
    in_process = "" if not predicted else f" (plans rebuilt in-process: {np.median(predicted):.0f})"
    return [f"  {b.name:12s} {len(runs)} repeat(s); plan: {sum(kinds.values()):.0f} chunks (batched {kinds['batched']:.0f}, "
            f"split {kinds['split']:.0f}, hybrid {kinds['hybrid']:.0f}), {np.median([s.elastic.num_pipelines for s in first]):.0f} "
            f"pipeline(s), recomputed layers per step {fmt_layers([s.elastic.recomputed_layers for s in first])}",
            f"  {'':12s} predicted ms {logged:.0f}{in_process} | measured (pipeline) ms {np.median(np.median(pipe, 0)):.0f} | "
            f"iteration ms {np.median(np.median(iters, 0)):.0f} | act MB per stage measured/predicted {mem}{ratios}"]


def report(name: str, measured: dict[Builder, list[list[StepMetrics]]], predicted: dict[Builder, list[float]],
           choice: BudgetChoice, failed: dict[Builder, str], out: Callable[[str], None] = print, entry: dict | None = None) -> dict:
    """Print one data set's results (per builder, then ratios and goals) and return its JSON entry
    (``entry``: the one :func:`summarize` made, measured ceilings added; None: made here)."""
    entry = summarize(measured, predicted, choice) if entry is None else entry
    out(f"\n== {name}: budget {choice.budget_gb:.4f} GB per stage; ms: medians per step (a step's time: median over repeats); "
        "act MB: peak over steps")
    epp = step_matrix(measured[EPP], pipe_ms) if measured.get(EPP) else None
    for b, runs in measured.items():
        for line in builder_lines(b, runs, predicted.get(b), epp):
            out(line)
        differ = sum(s.elastic.plan != p.summary() for s, p in zip(runs[0], choice.plans[b][1:]))
        if differ:
            out(f"  {'':12s} {differ} of {len(runs[0])} logged plans differ from the in-process ones (the simulated ratios "
                "are about the in-process plans)")
    for b, why in failed.items():
        out(f"  {b.name:12s} did not run: {why}")
    out(f"  ratios baseline / EPP (pipeline ms; median over steps of the per-step ratio; > 1: EPP faster); Megatron's plan "
        f"recomputes on {entry['megatron_recompute_steps']} of the measured steps; simulated: the planner's predicted ms of the same plans")
    for line in goal_lines(entry, BINDS[name]):
        out(line)
    return entry


def report_all(results: dict[str, tuple[BudgetChoice, dict, dict, dict]], config: dict, out: Callable[[str], None] = print) -> None:
    """Every data set's report (``results``: name -> (budget choice, predicted ms, measured runs, failed
    builders)), the goals, and last the JSON line."""
    entries = {name: summarize(measured, predicted, choice) for name, (choice, predicted, measured, failed) in results.items()}
    measured_ceilings(entries, results)
    entries = {name: report(name, measured, predicted, choice, failed, out, entries[name]) for name, (choice, predicted, measured, failed) in results.items()}
    out(f"\n{config['elapsed_s']} s; load average {config['load_average_end']:.2f} at the end. Goals: EPP <= 0.60x Megatron and "
        "<= 0.85x Seq1F1B (best k) where memory binds; >= 0.97x the better baseline where it does not.")
    out(json.dumps({**entries, "config": config}))


# --------------------------------------------------------------------------------------------- data


def run_argv(args, name: str) -> list[str]:
    """``pretrain_gpt.py`` flags of data set ``name``, without budget and builder."""
    if name == "stdlib":
        from megatron_epp.data.stdlib_corpus import ensure_stdlib_corpus

        data = ["--data-path", ensure_stdlib_corpus(progress=False), "--epp-truncate-documents"]
        gbs = args.stdlib_global_batch_size
    else:
        data = ["--data-path", wiki_dataset(args.seq_length, args.wiki_global_batch_size, args.iters + 1, args.seed)]
        gbs = args.wiki_global_batch_size
    return ["--elastic-pp", *data, "--tokenizer-type", "ByteTokenizer", "--split", "1,0,0", "--pipeline-model-parallel-size", "2",
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
            "--global-batch-size", str(gbs), "--seed", str(args.seed), "--lr", "3e-3",
            "--train-iters", str(args.iters + 1), "--log-interval", "1"]


# --------------------------------------------------------------------------------------------- main
def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 2 steps, cap 2048, k=4 (~3 min)")
    ap.add_argument("--simulate-only", action="store_true", help="budgets and the simulated comparison only, no training")
    ap.add_argument("--datasets", type=subset_of(DATASETS), default=list(DATASETS), help=f"comma-separated subset of {','.join(DATASETS)}")
    ap.add_argument("--repeats", type=int, default=None, help="runs per builder and data set (default 3; quick 1)")
    ap.add_argument("--iters", type=int, default=None, help="measured steps per run after one warm-up step (default 5; quick 2)")
    ap.add_argument("--seq-length", type=int, default=None, help="context cap (default 8192; quick 2048)")
    ap.add_argument("--stdlib-global-batch-size", type=int, default=2, help="stdlib documents per step (default 2)")
    ap.add_argument("--wiki-global-batch-size", type=int, default=8, help="wiki documents per step (default 8)")
    ap.add_argument("--seq1f1b-k", type=positive_ints, default=None, help="Seq1F1B's slice counts k, comma-separated (default 2,4,8; quick 4)")
    ap.add_argument("--epp-memory-budget", type=float, default=None, help="GB per stage for stdlib and wiki (default: chosen by the planner)")
    ap.add_argument("--nobind-memory-budget", type=float, default=None, help="GB per stage for wiki-nobind (default: chosen by the planner)")
    ap.add_argument("--num-layers", type=int, default=4, help="(default 4: 2 per stage)")
    ap.add_argument("--hidden-size", type=int, default=128, help="(default 128; FFN 4x)")
    ap.add_argument("--num-attention-heads", type=int, default=4, help="(default 4)")
    ap.add_argument("--seed", type=int, default=1234, help="data order and wiki lengths (default 1234)")
    args = ap.parse_args(argv)
    quick = args.quick
    defaults = {"repeats": (1, 3), "iters": (2, 5), "seq_length": (2048, 8192), "seq1f1b_k": ([4], [2, 4, 8])}
    for key, (q, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, q if quick else full)
    for flag in ("repeats", "iters", "seq_length", "stdlib_global_batch_size", "wiki_global_batch_size"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be >= 1")
    if any(k < 2 for k in args.seq1f1b_k):
        fail("--seq1f1b-k: every k must be >= 2 (k = 1 is Megatron packing at micro-batches of the cap)")
    for flag in ("epp_memory_budget", "nobind_memory_budget"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            fail(f"--{flag.replace('_', '-')} must be positive")
    return args


class Progress:
    """One line per finished run: which, how long, elapsed and an estimate of what is left."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def __call__(self, name: str, repeat: int, repeats: int, builder: Builder, seconds: float, note: str = "") -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        left = elapsed / self.done * (self.total - self.done)
        print(f"  [{name}] repeat {repeat + 1}/{repeats} {builder.name:12s} {seconds:5.1f} s{note} | run {self.done}/{self.total}, "
              f"{elapsed:.0f} s elapsed, ~{left:.0f} s left", flush=True)


def measure(name: str, argv: list[str], specs: list[Builder], choice: BudgetChoice, expected_tokens: list[int], args,
            progress: Progress) -> tuple[dict[Builder, list[list[StepMetrics]]], dict[Builder, str]]:
    """Every builder's runs (measured steps per repeat, warm-up dropped), builder order rotated per repeat.
    Every Seq1F1B k runs in the first repeat; later repeats run only the best of them (time)."""
    from megatron_epp.training.replay import run_pretrain

    measured: dict[Builder, list[list[StepMetrics]]] = {b: [] for b in specs}
    failed = {b: "cannot run at this budget (planned in-process)" for b in specs if choice.plans[b] is None}
    for r in range(args.repeats):
        best = first_repeat_best(measured) if r else None
        order = specs if r == 0 else [b for b in specs if b.family != SEQ1F1B or b == best]
        for b in order[r % len(order):] + order[: r % len(order)]:  # rotated: spreads drift over the builders
            if b in failed:
                continue
            t0 = time.perf_counter()
            try:
                steps = run_pretrain([*argv, "--epp-memory-budget", repr(choice.budget_gb), *b.flags()])
            except RuntimeError as error:
                failed[b] = str(error)
                progress(name, r, args.repeats, b, time.perf_counter() - t0, " FAILED")
                continue
            tokens = [s.tokens for s in steps]
            if tokens != expected_tokens:  # the batches must be the planned ones, under every builder
                failed[b] = f"tokens per step {tokens} differ from the planned batches' {expected_tokens}"
            else:
                measured[b].append(steps[1:])  # the first step warms up
            progress(name, r, args.repeats, b, time.perf_counter() - t0)
    return {b: runs for b, runs in measured.items() if b not in failed}, failed


def prepare(name: str, args, specs: list[Builder]) -> tuple[list[str], list[list[int]], BudgetChoice, dict[Builder, list[float]]]:
    """Data set ``name``: the run's flags, its batches (planned in-process), the budget and every
    builder's predicted step ms per measured step; prints what it found."""
    argv = run_argv(args, name)
    batches, build = planned_batches(argv, args.iters + 1)
    lengths = np.concatenate(batches)
    print(f"\n== {name}: {len(batches[0])} documents per step, tokens per step {[int(sum(b)) for b in batches]} (first: warm-up), "
          f"lengths p50 {np.median(lengths):.0f} p90 {np.percentile(lengths, 90):.0f} max {lengths.max()}, "
          f"{int(np.sum(lengths == args.seq_length))} at the cap", flush=True)
    if name != "stdlib":
        _, scales = wiki_lengths(args.seq_length, args.wiki_global_batch_size, args.iters + 1, args.seed)
        if any(max(b) != args.seq_length for b in batches):
            fail("the wiki batches are not the ones written (each should reach the cap): the sampler's order changed")
        print("  wiki: lengths drawn from wikipedia_lengths.txt.gz, each step's scaled by cap / its longest: x"
              + " x".join(f"{x:.2f}" for x in scales), flush=True)
    override = args.epp_memory_budget if BINDS[name] else args.nobind_memory_budget
    t0 = time.perf_counter()
    if override is not None:
        choice = BudgetChoice(override, "given", all_plans(specs, batches, build.cost_model, build.config, override))
    elif BINDS[name]:
        choice = choose_bind_budget(specs, batches, build.cost_model, build.config)
    else:
        choice = choose_nobind_budget(specs, batches, build.cost_model, build.config)
    if BINDS[name] and choice.plans.get(EPP) is not None:
        choice.unbound = unbound_epp_plans(batches, build.cost_model, build.config, choice.budget_gb)
    for line in choice.lines(BINDS[name]):
        print("  " + line)
    predicted = {b: [p.report.predicted_step_ms for p in ps[1:]] for b, ps in choice.plans.items() if ps is not None}
    sim = summarize({}, predicted, choice)["simulated"]
    ceiling = sim.get("ceiling")
    print(f"  simulated ({time.perf_counter() - t0:.0f} s of planning in-process), predicted ms median per step: "
          + ", ".join(f"{b.name} {np.median(p):.0f}" for b, p in predicted.items())
          + f" | ratios megatron {show(sim['megatron'])}, seq1f1b {show(sim['seq1f1b'])} (k={sim['seq1f1b_k']})"
          + f" | EPP / its compute bound {show(sim['epp_over_bound'])}"
          + ("" if ceiling is None else f" | ceiling (EPP with no memory limit, {ceiling['budget_gb']:.4f} GB): megatron "
             f"{show(ceiling['megatron'])}, seq1f1b {show(ceiling['seq1f1b'])}"), flush=True)
    return argv, batches, choice, predicted


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    specs = builders(args.seq1f1b_k)
    t0 = time.perf_counter()
    print(f"bench_elastic: pp=2 (torchrun, 1 thread per rank), {args.num_layers} layers, hidden {args.hidden_size}, "
          f"{args.num_attention_heads} heads, cap {args.seq_length}, {args.iters} measured steps after 1 warm-up x {args.repeats} "
          f"repeats, builders {', '.join(b.name for b in specs)}; {os.cpu_count()} cores, load average {load_average():.2f} "
          "(timings need the cores otherwise idle)", flush=True)
    config = {"seq_length": args.seq_length, "num_layers": args.num_layers, "hidden_size": args.hidden_size,
              "num_attention_heads": args.num_attention_heads, "pp": 2, "repeats": args.repeats, "iters": args.iters,
              "global_batch_size": {name: args.stdlib_global_batch_size if name == "stdlib" else args.wiki_global_batch_size
                                    for name in args.datasets},
              "seq1f1b_k": args.seq1f1b_k, "seed": args.seed, "load_average_start": load_average()}
    prepared = {name: prepare(name, args, specs) for name in args.datasets}
    if any(name != "stdlib" for name in args.datasets):
        config["wiki_step_scales"] = wiki_lengths(args.seq_length, args.wiki_global_batch_size, args.iters + 1, args.seed)[1].tolist()
    results = {}
    progress = None if args.simulate_only else Progress(len(prepared) * (len(specs) + (args.repeats - 1) * (2 + bool(args.seq1f1b_k))))
    if progress is not None:
        print(f"\nrunning {progress.total} runs (every Seq1F1B k in the first repeat, then only the best)", flush=True)
    for name, (argv_d, batches, choice, predicted) in prepared.items():
        measured, failed = ({}, {}) if progress is None else measure(name, argv_d, specs, choice, [int(sum(b)) for b in batches], args, progress)
        results[name] = (choice, predicted, measured, failed)
    config["elapsed_s"] = round(time.perf_counter() - t0)
    config["load_average_end"] = load_average()
    report_all(results, config)


if __name__ == "__main__":
    main()
