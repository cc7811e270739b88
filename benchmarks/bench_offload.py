#!/usr/bin/env python3
"""Activation offload on CPU: ``--epp-offload checkpoints`` against ``none`` at the same binding memory budget.

The claim measured (issue 41): at a budget where today's plans recompute, the planner's integer program, given the
host for recompute checkpoints, trains the same batches with fewer recomputed layers (a checkpoint in host memory frees
its bytes on the device for a layer that then need not recompute), the host memory it predicted is what the host pool
held, and its predicted step is as accurate as its predictions are today.

Both configurations run ``pretrain_gpt.py --elastic-pp`` at pp 2 under torchrun (CPU/gloo, two ranks, one thread each:
one rank per core), the same flags but ``--epp-offload``; dp 1, so each step trains the same global batch (checked by
every run's tokens per step against the batches planned in-process). ``checkpoints`` measures the copy bandwidth at
start-up and plans on it (the log's ``host link:`` line); on CPU a copy runs in the rank's own thread, so it hides
behind nothing and the measured step carries it. Both plan each batch between steps (``--epp-plan-between-steps``:
the two ranks take both cores). Model: ``--num-layers`` (4), ``--hidden-size`` (64), ``--num-attention-heads`` (4),
byte tokens. Data: ``bench_elastic.py``'s Wikipedia-length documents scaled so that every step has one at the cap
``--seq-length``.

Budget (GB per rank: model states + activations, as the planner counts them): the smallest on a 1/1024 GB grid at
which both configurations can run (their start-up check: a full batch of cap-length documents plannable), where memory
binds most; ``--epp-memory-budget`` overrides it. Printed with both configurations' planned recomputed layers per step.

Measurement (``benchmarks/paired_runs.py``, as ``bench_context_parallel.py``): ``--repeats`` (3) rounds, the two
alternating, each a launch of ``--iters`` (10) steps, step 1 a warm-up. Per configuration: recomputed layers per step
(summed over the chunks) and, with offload, the checkpoints on the host; the activation peak per stage measured against
the prediction and model states + peak <= the budget; the host pool's peak per stage against the prediction; the
calibrated predicted step against the measured one after step 5 (median, max; with the one factor that fits best in
hindsight); the noise floor (a configuration against itself between repeats); ``checkpoints / none`` measured step
time paired by step (what offload costs or saves here: fewer recomputes, plus copies that nothing hides on CPU).

Verdicts, against today's accuracy (``--accuracy-log``, the committed time-model measurement): ``checkpoints``
recomputes less (in total over the steps, its most over the repeats below ``none``'s least; the steps where it
recomputes more are counted: the plans differ in chunking too); its host prediction equals the host pool's peak on
every step that offloads; its median error within today's largest median and its worst step within today's worst.

The last line is one JSON object: ``budget_gb``, per configuration (``none``, ``checkpoints``) the figures of
``paired_runs.summarize`` (``recomputed``, ``offloaded``, ``host_pred_mb``/``host_meas_mb``, ``host_exact``,
``pred_err_median``/``pred_err_max``, ``noise``, ...), ``checkpoints_over_none`` (measured) and
``checkpoints_over_none_predicted``, ``steps_more_recompute``, ``failed``, ``today``, ``verdict`` (``less_recompute``,
``host_exact``, ``within_today``), ``config``. Duration on 2 idle cores: about 2 minutes with the defaults;
``--simulate-only``: the budget and the plans, no training (seconds).

    OMP_NUM_THREADS=1 python -m benchmarks.bench_offload [--repeats 3] [--iters 10] [--seq-length 2048]
        [--global-batch-size 4] [--num-layers 4] [--hidden-size 64] [--num-attention-heads 4] [--epp-memory-budget GB]
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

MODES = ("none", "checkpoints")
PP = 2


def run_argv(args, mode: str) -> list[str]:
    """``pretrain_gpt.py`` flags of the ``mode`` run (``--epp-offload mode``), without the budget."""
    return [*cp_run_argv(args, 1, pp=PP), "--epp-offload", mode]


def choose_budget(batches, builds: dict[str, OnlinePlanner]) -> float:
    """The smallest grid budget at which both configurations can run."""

    def ok(b: float) -> bool:
        return all(plan_steps(ELASTIC, batches, build.cost_model, build.config, b) is not None for build in builds.values())

    return smallest_budget(ok, "lets both configurations run")[0]


def verdicts(entries: dict[str, dict], today: dict) -> dict:
    """``checkpoints`` recomputes less than ``none`` (in total, its most over the repeats below ``none``'s least); its
    host prediction exact on every step that offloads; its predicted step within today's accuracy."""
    none, ckpt = entries.get("none"), entries.get("checkpoints")
    out = {"less_recompute": None, "host_exact": None, "within_today": None}
    if none is not None and ckpt is not None:
        out["less_recompute"] = bool(max(ckpt["recomputed_totals"]) < min(none["recomputed_totals"]))
    if ckpt is not None:
        out["host_exact"] = ckpt["host_exact"]
        if ckpt["pred_err_median"] is not None:
            out["within_today"] = ckpt["pred_err_median"] <= today["median_max"] and ckpt["pred_err_max"] <= today["worst_step"]
    return out


def steps_more_recompute(entries: dict[str, dict]) -> int | None:
    """Steps where ``checkpoints``' most over its repeats exceeds ``none``'s least (the plans' chunkings differ)."""
    if "none" not in entries or "checkpoints" not in entries:
        return None
    return int((np.max(entries["checkpoints"]["recomputed"], axis=0) > np.min(entries["none"]["recomputed"], axis=0)).sum())


def report(entries: dict[str, dict], ratio: float | None, predicted_ratio: float | None, today: dict, budget_gb: float,
           failed: dict[str, str]) -> dict:
    """Print the figures and verdicts; return the verdicts."""
    print(f"\n== budget {budget_gb:.4f} GB per rank; ms: medians over steps 2.. (a step's time: median over repeats); "
          f"prediction error: every step after step {CALIBRATE_FIRST_STEP} of every repeat")
    for name, e in entries.items():
        acts = ", ".join(f"{p:.2f}/{m:.2f}" for p, m in zip(e["act_pred_mb"], e["act_meas_mb"]))
        rec = " ".join(dict.fromkeys(fmt_layers(r) for r in e["recomputed"]))
        host = ("" if e["host_pred_mb"] is None else
                f" | offloaded checkpoints per step {' '.join(dict.fromkeys(fmt_layers(r) for r in e['offloaded']))}; host MB "
                f"per stage pred/meas {', '.join(f'{p:.2f}/{m:.2f}' for p, m in zip(e['host_pred_mb'], e['host_meas_mb']))}, "
                f"equal on {'every' if e['host_exact'] else 'NOT every'} one of the {e['host_steps']} steps that offload")
        print(f"  {name}: {e['repeats']} repeat(s); recomputed layers per step {rec}, in total "
              f"{'/'.join(map(str, e['recomputed_totals']))} per repeat{host} | act MB per stage pred/meas {acts}, worst "
              f"|pred/meas - 1| {e['act_worst_err']:.2%}, states + peak <= budget: {'ok' if e['fits'] else 'FAIL'}")
        noise = "n/a (1 repeat)" if e["noise"] is None else f"{e['noise']:.1%}"
        print(f"  {'':4s} measured ms {e['measured_ms']:.0f}, predicted ms {e['predicted_ms']:.0f} | |pred/meas - 1| median "
              f"{pct(e['pred_err_median'])}, max {pct(e['pred_err_max'])} ({e['pred_err_steps']} steps; with the one factor "
              f"that fits them best in hindsight: median {pct(e['hindsight_median'])}, max {pct(e['hindsight_max'])}) | "
              f"noise floor {noise} | steps whose plan differs between repeats: {e['plans_differ']}")
    for name, why in failed.items():
        print(f"  {name}: did not run: {why}")
    v = verdicts(entries, today)
    if ratio is not None:
        print(f"  checkpoints / none step time measured {ratio:.2f} (paired by step), predicted {predicted_ratio:.2f} (the runs' "
              f"calibrated predictions of the steps after step {CALIBRATE_FIRST_STEP}); steps where checkpoints recomputes "
              f"more than none: {steps_more_recompute(entries)}")
    print(f"  today's accuracy ({today['log']}): largest per-configuration median {today['median_max']:.1%}, worst step "
          f"{today['worst_step']:.1%} (goal {today['goal']:.0%})")
    yes = {True: "yes", False: "NO", None: "n/a"}
    ckpt, none = entries.get("checkpoints", {}), entries.get("none", {})
    print(f"  checkpoints recomputes less than none: {yes[v['less_recompute']]}; its host prediction exact: {yes[v['host_exact']]}; "
          f"its predicted step within today's accuracy: {yes[v['within_today']]} (checkpoints median {pct(ckpt.get('pred_err_median'))}, "
          f"max {pct(ckpt.get('pred_err_max'))}; none in this run median {pct(none.get('pred_err_median'))}, max "
          f"{pct(none.get('pred_err_max'))})")
    return v


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = run_parser(__doc__, num_layers=4).parse_args(argv)
    args.epp_plan_between_steps = True  # cp_run_argv's: both ranks take both cores
    check_run_args(args)
    if args.num_layers % PP:
        fail(f"--num-layers {args.num_layers}: pp {PP} must divide it")
    return args


def header(args) -> str:
    return (f"bench_offload: pp {PP} (2 ranks), --epp-offload none vs checkpoints, {args.num_layers} layers, hidden "
            f"{args.hidden_size}, {args.num_attention_heads} heads, cap {args.seq_length}, {args.global_batch_size} documents per "
            f"step, {args.iters} steps per launch x {args.repeats} repeats, planning between steps; {os.cpu_count()} cores, "
            f"load average {load_average():.2f} (timings need the cores otherwise idle)")


def main(argv: Sequence[str] | None = None) -> None:
    t0 = time.perf_counter()
    args = parse(argv)
    today = today_accuracy(args.accuracy_log)
    print(header(args), flush=True)
    argvs = {mode: run_argv(args, mode) for mode in MODES}
    batches, builds = same_batches(argvs, {mode: PP for mode in MODES}, args.iters, args.seq_length)
    budget = args.epp_memory_budget if args.epp_memory_budget is not None else choose_budget(batches, builds)
    plans = plan_facts(batches, builds, budget)
    rec = {mode: recomputed(p) for mode, p in plans.items()}
    print(f"  budget {budget:.4f} GB per rank ({'given' if args.epp_memory_budget is not None else 'the smallest at which both run'}); "
          f"planned recomputed layers per step (the host link assumed in-process; the runs measure theirs): none {fmt_layers(rec['none'])}, "
          f"checkpoints {fmt_layers(rec['checkpoints'])}"
          + ("" if rec["none"] is None or any(rec["none"]) else " -- memory does NOT bind here"), flush=True)
    config = {"seq_length": args.seq_length, "global_batch_size": args.global_batch_size, "num_layers": args.num_layers,
              "hidden_size": args.hidden_size, "num_attention_heads": args.num_attention_heads, "repeats": args.repeats,
              "iters": args.iters, "seed": args.seed, "pp": PP, "load_average_start": load_average(), "planned_recomputed": rec}
    if args.simulate_only:
        config["elapsed_s"] = round(time.perf_counter() - t0)
        print(json.dumps({"budget_gb": budget, "simulate_only": True, "config": config}))
        return
    failed = {mode: "cannot run at this budget (planned in-process)" for mode in MODES if plans[mode] is None}
    runs = alternating_runs(MODES, argvs, {mode: PP for mode in MODES}, budget, args.repeats, [int(sum(b)) for b in batches], failed)
    entries = {mode: summarize(rs, budget) for mode, rs in runs.items() if rs and mode not in failed}
    ratio = predicted_ratio = None
    if len(entries) == 2:
        ratio, predicted_ratio = paired_ratios(runs["none"], runs["checkpoints"])
    v = report(entries, ratio, predicted_ratio, today, budget, failed)
    config["elapsed_s"] = round(time.perf_counter() - t0)
    config["load_average_end"] = load_average()
    print(f"\n{config['elapsed_s']} s; load average {config['load_average_end']:.2f} at the end")
    print(json.dumps({"budget_gb": budget, **entries, "checkpoints_over_none": ratio, "checkpoints_over_none_predicted": predicted_ratio,
                      "steps_more_recompute": steps_more_recompute(entries), "failed": failed, "today": today, "verdict": v,
                      "config": config}))


if __name__ == "__main__":
    main()
