#!/usr/bin/env python3
"""Context parallelism inside a stage on CPU: cp 2 (2 ranks) against cp 1 (1 rank) at the same per-rank memory budget.

The claim measured (issue 32): at a per-rank ``--epp-memory-budget`` that binds, ``--context-parallel-size 2
--cp-comm-type a2a`` trains the documents whose cp 1 plan must recompute with less recompute (a CP rank holds
``1 / 2`` of a chunk's activations outside attention, ``heads / 2`` inside it), and the planner's predicted step at
cp 2 is as accurate as its predictions are today.

Both configurations run ``pretrain_gpt.py --elastic-pp`` at pp 1 under torchrun (CPU/gloo, one thread per rank):
cp 1 on one rank, cp 2 on two ranks (a stage of two CP ranks; dp 1 in both, so each step trains the same global
batch: same data, same seed, checked by every run's tokens per step against the batches planned in-process).
Both plan each batch between steps (``--epp-plan-between-steps``; ``--no-epp-plan-between-steps``: in a background
thread during the step before, training's default): cp 2's two ranks take both cores, and a planner thread inside its
timed steps was most of its noise (2026-11-27, ``docs/measurements/2026-11-27-cpu-cp/``).
Model: ``--num-layers`` (2), ``--hidden-size`` (64), ``--num-attention-heads`` (4), byte tokens. Data:
``bench_elastic.py``'s Wikipedia-length documents (random bytes, each step's lengths scaled so that its longest
document reaches the cap ``--seq-length``): every step has a document at the cap, where memory binds.

Budget (GB per rank: model states + activations, as the planner counts them), chosen from the planner in-process
on the runs' own batches and cost models (``bench_elastic.py``'s grid and bisection): the smallest on a 1/1024 GB
grid at which cp 2's plans need no recompute on any step and cp 1 can still run (its start-up check: a full batch
of cap-length documents plannable). Printed with both configurations' recomputed layers per step there; memory
binds when cp 1 recomputes on a step. ``--epp-memory-budget`` overrides the choice (the same facts printed).

Measurement: ``--repeats`` (3) rounds, cp 1 and cp 2 alternating (the order swapped every round to spread drift);
each run is one launch of ``--iters`` (10) steps, step 1 a warm-up. Per configuration:

* recomputed layers per step, summed over the step's chunks (the runs' records; plans after step 5 are made on
  the calibrated cost model, so they may differ between repeats);
* activation peak per rank, measured (at cp 2 the larger CP rank's) against the planner's prediction, worst
  ``|predicted / measured - 1|`` over steps and repeats, and model states + measured peak <= the budget;
* step time: the driver's calibrated predicted ms (the cost model refitted on the run's steps 2..5, as
  ``time_model_accuracy.py`` measures it) against the measured ms (``forward_backward_elastic``), error
  ``|predicted / measured - 1|`` of every step after step 5 of every repeat: median and max;
* noise floor: the configuration against itself, median over steps and pairs of repeats of ``|t_r / t_r' - 1|``
  (``bench_elastic.noise_floor``);
* cp 2 / cp 1 measured step time, per step (a step's time: median over repeats), median over the steps after the
  warm-up (< 1: cp 2 faster; it runs on twice the cores: reported, not a goal).

"Today's accuracy" is read from the committed time-model measurement (``--accuracy-log``, default
``docs/measurements/2026-11-24-cpu/time_model_accuracy_fc6a2b3.log``, the README's benchmark line): the largest
per-configuration median calibrated error there and its worst step. Verdicts printed: cp 2 recomputes fewer layers
than cp 1 (its most over the repeats against cp 1's least: on no step more, in total fewer); cp 2's median error
within today's largest median and its worst step within today's worst step; the same run's cp 1 error beside it
(the same machine and load).

The last line is one JSON object: ``budget_gb``, per configuration (``cp1``, ``cp2``) ``recomputed`` (layers per
step summed over the chunks, per repeat), ``recomputed_totals`` (per repeat), ``act_pred_mb``/``act_meas_mb`` (peak per rank over the steps),
``act_worst_err``, ``states_mb`` (model states per rank), ``act_meas_cp_mb`` (each CP rank's peak), ``fits``, ``pred_err_median``/``pred_err_max``, ``measured_ms``/``predicted_ms`` (medians),
``hindsight_median``/``hindsight_max`` (the error left with the one factor that fits the steps best: scale or shape),
``per_step`` (``[repeat, iteration, predicted / measured - 1, predicted ms, measured ms]`` after step 5), ``noise``,
``plans_differ`` (steps whose plan is not the same in every repeat); ``cp2_over_cp1`` and ``cp2_over_cp1_predicted``
(the runs' calibrated predictions, steps after 5); ``speed_factor``/``stage_overhead_ms`` per repeat (each run's last
calibration) and ``cp2_speed_factor_over_cp1`` (1: the uncalibrated cost model scales from cp 1 to cp 2 as the machine
does); ``failed``; ``today`` (the
reference figures and their log); ``verdict`` (``less_recompute``, ``within_today``); ``config``.
Duration on 2 idle cores: about 2 minutes with the defaults (6 launches of ~15 s start-up plus 10 short steps);
``--simulate-only``: the budget and the plans, no training (seconds).

    OMP_NUM_THREADS=1 python -m benchmarks.bench_context_parallel [--repeats 3] [--iters 10] [--seq-length 2048]
        [--global-batch-size 4] [--num-layers 2] [--hidden-size 64] [--num-attention-heads 4] [--epp-memory-budget GB]
        [--simulate-only]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np


from megatron_epp.planner.builders import ELASTIC
from megatron_epp.planner.config import CALIBRATE_FIRST_STEP
from benchmarks.common import (fail, plan_steps, recomputed, smallest_budget, fmt_layers,
                              load_average, cp_run_argv)
from benchmarks.paired_runs import alternating_runs, paired_ratios, plan_facts, same_batches, check_run_args, pct, run_parser, summarize, today_accuracy

if TYPE_CHECKING:
    from megatron_epp.planner.online import OnlinePlanner

CPS = (1, 2)


# --------------------------------------------------------------------------------------------- planning
def choose_budget(batches, builds: dict[int, OnlinePlanner]) -> float:
    """The smallest grid budget at which cp 2's plans need no recompute and cp 1 can run."""

    def ok(b: float) -> bool:
        cp2 = recomputed(plan_steps(ELASTIC, batches, builds[2].cost_model, builds[2].config, b))
        return cp2 is not None and not any(cp2) and plan_steps(ELASTIC, batches, builds[1].cost_model, builds[1].config, b) is not None

    return smallest_budget(ok, "lets cp 2 plan without recompute and cp 1 run")[0]


def verdicts(entries: dict[str, dict], today: dict) -> dict:
    """cp 2 recomputes less than cp 1 (fewer layers on some step, more on none); cp 2's predicted step within
    today's accuracy (median error <= today's largest median, worst step <= today's worst)."""
    one, two = entries.get("cp1"), entries.get("cp2")
    out = {"less_recompute": None, "within_today": None}
    if one is not None and two is not None:  # cp 2's most over its repeats against cp 1's least, step by step
        least, most = np.min(one["recomputed"], axis=0), np.max(two["recomputed"], axis=0)
        out["less_recompute"] = bool((most <= least).all() and most.sum() < least.sum())
    if two is not None and two["pred_err_median"] is not None:
        out["within_today"] = two["pred_err_median"] <= today["median_max"] and two["pred_err_max"] <= today["worst_step"]
    return out


def report(entries: dict[str, dict], ratio: float | None, predicted_ratio: float | None, today: dict, budget_gb: float,
           failed: dict[str, str]) -> dict:
    """Print the figures and verdicts; return the verdicts."""
    print(f"\n== budget {budget_gb:.4f} GB per rank; ms: medians over steps 2.. (a step's time: median over repeats); "
          f"prediction error: every step after step {CALIBRATE_FIRST_STEP} of every repeat")
    for name, e in entries.items():
        acts = ", ".join(f"{p:.2f}/{m:.2f}" for p, m in zip(e["act_pred_mb"], e["act_meas_mb"]))
        if e["act_meas_cp_mb"] is not None:
            acts += " (meas per CP rank " + " ".join(f"{m:.2f}" for stage in e["act_meas_cp_mb"] for m in stage) + ")"
        acts += ", model states " + ", ".join(f"{m:.2f}" for m in e["states_mb"])
        rec = " ".join(dict.fromkeys(fmt_layers(r) for r in e["recomputed"]))  # each different one once
        print(f"  {name}: {e['repeats']} repeat(s); recomputed layers per step (over the chunks) {rec}, in total "
              f"{'/'.join(map(str, e['recomputed_totals']))} per repeat | "
              f"act MB per rank pred/meas {acts}, worst |pred/meas - 1| {e['act_worst_err']:.2%}, states + peak <= budget: "
              f"{'ok' if e['fits'] else 'FAIL'}")
        noise = "n/a (1 repeat)" if e["noise"] is None else f"{e['noise']:.1%}"
        print(f"  {'':4s} measured ms {e['measured_ms']:.0f}, predicted ms {e['predicted_ms']:.0f} | |pred/meas - 1| median "
              f"{pct(e['pred_err_median'])}, max {pct(e['pred_err_max'])} ({e['pred_err_steps']} steps; with the one factor "
              f"that fits them best in hindsight: median {pct(e['hindsight_median'])}, max {pct(e['hindsight_max'])}) | "
              f"noise floor {noise} | calibration s {'/'.join('n/a' if x is None else f'{x:.2f}' for x in e['speed_factor'])} | "
              f"steps whose plan differs between repeats: {e['plans_differ']}")
    for name, why in failed.items():
        print(f"  {name}: did not run: {why}")
    v = verdicts(entries, today)
    if ratio is not None:
        print(f"  cp 2 / cp 1 step time measured {ratio:.2f} (paired by step; cp 2 runs on 2 cores, cp 1 on 1), predicted "
              f"{predicted_ratio:.2f} (the runs' calibrated predictions of the steps after step {CALIBRATE_FIRST_STEP})")
    print(f"  today's accuracy ({today['log']}): largest per-configuration median {today['median_max']:.1%}, worst step "
          f"{today['worst_step']:.1%} (goal {today['goal']:.0%})")
    yes = {True: "yes", False: "NO", None: "n/a"}
    print(f"  cp 2 recomputes less than cp 1: {yes[v['less_recompute']]}; cp 2's predicted step within today's accuracy: "
          f"{yes[v['within_today']]} (cp 2 median {pct(entries.get('cp2', {}).get('pred_err_median'))}, max "
          f"{pct(entries.get('cp2', {}).get('pred_err_max'))}; cp 1 in this run median "
          f"{pct(entries.get('cp1', {}).get('pred_err_median'))}, max {pct(entries.get('cp1', {}).get('pred_err_max'))})")
    return v


# --------------------------------------------------------------------------------------------- main
def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = run_parser(__doc__, num_layers=2, heads_help="; cp 2 must divide it")
    ap.add_argument("--epp-plan-between-steps", action=argparse.BooleanOptionalAction, default=True,
                    help="both configurations plan each batch between steps (pretrain_gpt.py's flag), so that at cp 2, "
                         "whose 2 ranks take both cores, the planner's thread does not share a core with a rank inside "
                         "the timed steps (default); --no-epp-plan-between-steps: in the background, as training does by "
                         "default")
    args = ap.parse_args(argv)
    check_run_args(args)
    if args.num_attention_heads % 2:
        fail(f"--num-attention-heads {args.num_attention_heads}: cp 2 must divide it")
    return args


def header(args) -> str:
    """The first line: what runs, and the machine's load."""
    return (f"bench_context_parallel: pp 1, cp 1 (1 rank) vs cp 2 (2 ranks, a2a), {args.num_layers} layers, hidden "
            f"{args.hidden_size}, {args.num_attention_heads} heads, cap {args.seq_length}, {args.global_batch_size} documents per "
            f"step, {args.iters} steps per launch x {args.repeats} repeats, planning "
            f"{'between steps' if args.epp_plan_between_steps else 'in the background'}; {os.cpu_count()} cores, "
            f"load average {load_average():.2f} (timings need the cores otherwise idle)")


def main(argv: Sequence[str] | None = None) -> None:
    t0 = time.perf_counter()
    args = parse(argv)
    today = today_accuracy(args.accuracy_log)
    print(header(args), flush=True)
    argvs = {cp: cp_run_argv(args, cp) for cp in CPS}
    batches, builds = same_batches(argvs, {cp: cp for cp in CPS}, args.iters, args.seq_length)
    budget = args.epp_memory_budget if args.epp_memory_budget is not None else choose_budget(batches, builds)
    plans = plan_facts(batches, builds, budget)
    rec = {cp: recomputed(p) for cp, p in plans.items()}
    print(f"  budget {budget:.4f} GB per rank ({'given' if args.epp_memory_budget is not None else 'the smallest at which cp 2 needs no recompute and cp 1 runs'}); "
          f"planned recomputed layers per step: cp 1 {fmt_layers(rec[1])}, cp 2 {fmt_layers(rec[2])}"
          + ("" if rec[1] is None or any(rec[1]) else " -- memory does NOT bind for cp 1 here"), flush=True)
    config = {"seq_length": args.seq_length, "global_batch_size": args.global_batch_size, "num_layers": args.num_layers,
              "hidden_size": args.hidden_size, "num_attention_heads": args.num_attention_heads, "repeats": args.repeats,
              "iters": args.iters, "seed": args.seed, "plan_between_steps": args.epp_plan_between_steps,
              "load_average_start": load_average(),
              "planned_recomputed": {f"cp{cp}": r for cp, r in rec.items()}}
    if args.simulate_only:
        config["elapsed_s"] = round(time.perf_counter() - t0)
        print(json.dumps({"budget_gb": budget, "simulate_only": True, "config": config}))
        return
    expected = [int(sum(b)) for b in batches]
    failed = {f"cp{cp}": "cannot run at this budget (planned in-process)" for cp in CPS if plans[cp] is None}
    named = alternating_runs([f"cp{cp}" for cp in CPS], {f"cp{cp}": argvs[cp] for cp in CPS}, {f"cp{cp}": cp for cp in CPS},
                             budget, args.repeats, expected, failed)
    runs = {cp: named[f"cp{cp}"] for cp in CPS}
    entries = {f"cp{cp}": summarize(rs, budget) for cp, rs in runs.items() if rs and f"cp{cp}" not in failed}
    ratio = predicted_ratio = speed = None
    if len(entries) == 2:
        ratio, predicted_ratio = paired_ratios(runs[1], runs[2])
        speed = float(np.median(entries["cp2"]["speed_factor"]) / np.median(entries["cp1"]["speed_factor"]))
    v = report(entries, ratio, predicted_ratio, today, budget, failed)
    if speed is not None:
        print(f"  speed factor fitted at cp 2 / at cp 1: {speed:.2f} (medians over the repeats; 1: the cost model's cp 2 time, "
              "all-to-alls included, scales as the machine runs it, before any calibration)")
    config["elapsed_s"] = round(time.perf_counter() - t0)
    config["load_average_end"] = load_average()
    print(f"\n{config['elapsed_s']} s; load average {config['load_average_end']:.2f} at the end")
    print(json.dumps({"budget_gb": budget, **entries, "cp2_over_cp1": ratio, "cp2_over_cp1_predicted": predicted_ratio,
                      "cp2_speed_factor_over_cp1": speed, "failed": failed, "today": today, "verdict": v,
                      "config": config}))


if __name__ == "__main__":
    main()
