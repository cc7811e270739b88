#!/usr/bin/env python3
"""Where the planner runs, on a host whose training ranks take every core: in a background thread during the step
before (training's default) or between steps (``--epp-plan-between-steps``).

The planning rank (the first of each model replica) plans the next global batch while the current step runs; on a
host with a core per rank that thread shares a core with a training rank. This script measures what that costs, on
the same batches, paired per step, in two configurations of 2 ranks (one thread each) on this machine:

* ``main-job``: the main job's model, data and budget (``scripts/main_job.sh``'s: pp 2, 2 layers, hidden 64, the
  standard-library corpus at a 4096 cap, 8 documents per step, 0.03 GB; a constant learning rate, no clipping and no
  evaluation here);
* ``cp2``: ``bench_context_parallel.py``'s cp 2 run, its flags (pp 1, ``--context-parallel-size 2``, 2 layers, hidden 128,
  8 heads, Wikipedia lengths at a 2048 cap, 4 documents per step, ``--cp2-budget`` 0.0264 GB: the budget that
  script chose at this shape on 2026-11-27, where cp 2's plans need no recompute and the planner's search is that of
  a binding budget): every layer's all-to-alls wait for the slower rank, so a rank slowed by the planner slows both.

Each (configuration, placement) runs ``--repeats`` (3) launches of ``--iters`` (12) steps, the placements alternating
(order swapped every round). Per step: the whole iteration (``iter_ms``: the step, the optimizer, and the planning
the iteration waited for) and the timed step (``measured_ms``: ``forward_backward_elastic``, what the planner's cost
model predicts). Reported per configuration, steps 2.. (step 1 is a warm-up), a step's time the median over repeats:
between / background of the iteration and of the timed step (median over steps; < 1: planning between steps is
faster), each placement's noise floor (its repeats against each other, median over steps and pairs), and the
planner's time per step (its median: ``planning ms``, and with planning between steps all of it exposed).

Last line: one JSON object: per configuration ``iter_ratio`` and ``step_ratio`` (between / background), ``noise``
(per placement, of ``iter_ms``), ``iter_ms`` and ``step_ms`` (medians per placement), ``planning_ms`` (median per
placement), ``exposed_ms`` (median per placement); ``config``. About 3 minutes on 2 idle cores.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_planning_placement [--repeats 3] [--iters 12] [--configs main-job,cp2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Sequence

import numpy as np


from megatron_epp.training.metrics import StepMetrics
from benchmarks.common import Parser, fail, step_matrix, paired_ratio, noise_floor, load_average, cp_run_argv

PLACEMENTS = ("background", "between")
CONFIGS = ("main-job", "cp2")


def config_argv(name: str, iters: int, cp2_budget: float) -> list[str]:
    """``pretrain_gpt.py`` flags of a configuration (2 ranks), planning in the background."""
    if name == "main-job":
        from megatron_epp.data.stdlib_corpus import ensure_stdlib_corpus

        return ["--elastic-pp", "--tokenizer-type", "ByteTokenizer", "--num-layers", "2", "--lr", "3e-3",
                "--train-iters", str(iters), "--log-interval", "1", "--seed", "1234",
                "--data-path", str(ensure_stdlib_corpus()), "--pipeline-model-parallel-size", "2",
                "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "4096", "--epp-truncate-documents",
                "--global-batch-size", "8", "--epp-memory-budget", "0.03"]
    cp2 = argparse.Namespace(seq_length=2048, global_batch_size=4, iters=iters, seed=1234, num_layers=2, hidden_size=128,
                             num_attention_heads=8, epp_plan_between_steps=False)
    return [*cp_run_argv(cp2, 2), "--epp-memory-budget", repr(cp2_budget)]


def placement_flags(placement: str) -> list[str]:
    return ["--epp-plan-between-steps"] if placement == "between" else []


def summarize(runs: dict[str, list[list[StepMetrics]]]) -> dict:
    """One configuration's figures from its runs per placement (every step, the warm-up first)."""
    iters = {p: step_matrix([r[1:] for r in rs], lambda s: s.iter_ms) for p, rs in runs.items()}
    steps = {p: step_matrix([r[1:] for r in rs], lambda s: s.elastic.measured_ms) for p, rs in runs.items()}
    med = lambda values: float(np.median(values))  # noqa: E731
    return {
        # paired_ratio(base, other) is the median over steps of base / other: between / background here
        "iter_ratio": paired_ratio(iters["between"], iters["background"]),
        "step_ratio": paired_ratio(steps["between"], steps["background"]),
        "noise": {p: noise_floor(m) for p, m in iters.items()},
        "iter_ms": {p: med(m) for p, m in iters.items()},
        "step_ms": {p: med(m) for p, m in steps.items()},
        "planning_ms": {p: med([s.elastic.planning_ms for r in rs for s in r[1:]]) for p, rs in runs.items()},
        "exposed_ms": {p: med([s.elastic.planning_wait_ms for r in rs for s in r[1:]]) for p, rs in runs.items()},
    }


def report(name: str, f: dict) -> str:
    noise = ", ".join(f"{p} {f['noise'][p]:.1%}" if f["noise"][p] is not None else f"{p} n/a" for p in PLACEMENTS)
    return (f"  {name}: between / background: iteration {f['iter_ratio']:.3f}, timed step {f['step_ratio']:.3f} "
            f"(< 1: between steps faster) | iteration ms {f['iter_ms']['background']:.0f} / {f['iter_ms']['between']:.0f}, "
            f"timed step ms {f['step_ms']['background']:.0f} / {f['step_ms']['between']:.0f} (background / between) | "
            f"planning ms {f['planning_ms']['background']:.0f} / {f['planning_ms']['between']:.0f}, of it exposed "
            f"{f['exposed_ms']['background']:.1f} / {f['exposed_ms']['between']:.1f} | noise floor of the iteration: {noise}")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="launches per configuration and placement (default 3)")
    ap.add_argument("--iters", type=int, default=12, help="steps per launch, the first a warm-up (default 12)")
    ap.add_argument("--cp2-budget", type=float, default=0.0264, help="--epp-memory-budget of the cp2 runs (default 0.0264)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)} (default: both)")
    args = ap.parse_args(argv)
    args.configs = args.configs.split(",")
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        fail(f"--configs: unknown {', '.join(unknown)} (choose from {', '.join(CONFIGS)})")
    if args.cp2_budget <= 0:
        fail("--cp2-budget must be positive")
    if args.repeats < 1:
        fail("--repeats must be >= 1")
    if args.iters < 3:
        fail(f"--iters {args.iters}: needs at least 3 (the first is a warm-up)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    t0 = time.perf_counter()
    args = parse(argv)
    from megatron_epp.training.replay import run_pretrain

    print(f"bench_planning_placement: 2 ranks, one thread each, on {len(os.sched_getaffinity(0))} cores; configurations "
          f"{', '.join(args.configs)}; {args.repeats} repeats x {args.iters} steps per placement; load average "
          f"{load_average():.2f} (timings need the cores otherwise idle)", flush=True)
    out: dict = {}
    for name in args.configs:
        argv_ = config_argv(name, args.iters, args.cp2_budget)
        runs: dict[str, list[list[StepMetrics]]] = {p: [] for p in PLACEMENTS}
        for r in range(args.repeats):
            for p in (PLACEMENTS if r % 2 == 0 else PLACEMENTS[::-1]):
                steps = run_pretrain([*argv_, *placement_flags(p)], nproc=2)
                runs[p].append(steps)
                print(f"  {name} repeat {r + 1}/{args.repeats} {p}: iteration ms "
                      + " ".join(f"{s.iter_ms:.0f}" for s in steps), flush=True)
        tokens = {p: [[s.tokens for s in run] for run in rs] for p, rs in runs.items()}
        if any(t != tokens["background"][0] for rs in tokens.values() for t in rs):
            fail(f"{name}: the runs trained different batches")
        out[name] = summarize(runs)
        print(report(name, out[name]), flush=True)
    config = {"repeats": args.repeats, "iters": args.iters, "cp2_budget": args.cp2_budget, "elapsed_s": round(time.perf_counter() - t0),
              "load_average_end": load_average(), "cores": len(os.sched_getaffinity(0))}
    print(f"\n{config['elapsed_s']} s; load average {config['load_average_end']:.2f} at the end")
    print(json.dumps({**out, "config": config}))


if __name__ == "__main__":
    main()
