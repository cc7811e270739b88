#!/usr/bin/env python3
"""How well the time model predicts this machine's steps once the driver has calibrated it online.

Runs ``pretrain_gpt.py --elastic-pp`` under torchrun (pp=2, CPU/gloo, one thread per rank) on
held-out configurations: model shapes, context caps, corpora and plan builders other than those the
shipped profiles' overheads were fitted on (``benchmarks/calibrate_step.py``: hidden 64 and hidden 128,
4 heads, 4 layers, cap 1024, 16 documents of the stdlib corpus or mock data; the runs plan on the
profile measured nearest their shape, ``--epp-profile cpu``). Each configuration runs twice:

* calibrated: the driver's default ``--epp-calibrate-interval``: it fits the speed factor ``s`` and the
  per-chunk stage overhead ``o`` on its own steps 2..5 (step 1 is warm-up) and plans and predicts the
  following steps on them (refitting every interval); the error of steps 6..N is reported;
* static: ``--epp-calibrate-interval 0``, the profile as shipped (its predictions are the profiling
  machine's times), steps 6..N of that run, for comparison.

Error per step: |predicted / measured - 1| with the log's ``predicted ms`` and ``measured ms`` (the
span of ``forward_backward_elastic`` on the last stage, which the simulator predicts). Goal: <= 10 %
on every calibrated step. Prints a table per configuration, then every calibrated step that missed
the goal with what may explain it: the planner's time inside the step (``planning_overlap_ms``: the
next step's plan, made in a thread on the planning rank's core), its chunks, the error left with the
speed factor that fits the run's steps best in hindsight (a calibration's bias vs step-to-step
scatter). The noise floor: the two runs of a configuration draw the same batches, and where both ran
plans of the same summary (always with ``--epp-plan megatron``/``seq1f1b``) the same step was measured
twice; |ratio / median ratio - 1| of those pairs is what the machine alone moves a step by, and no
time model can be held to a goal below it. The last line is one JSON object with the per-configuration
median and max errors (calibrated and static), the fitted ``s`` and ``o``, the hindsight error, the
noise floor, and every calibrated step as ``[iteration, predicted/measured - 1, chunks, planning
overlap ms, measured ms]``.

    python -m benchmarks.time_model_accuracy            # 6 configurations x 30 steps, twice
    python -m benchmarks.time_model_accuracy --iters 20 # 6 x 20 steps, twice: ~5 min on a quiet machine
    python -m benchmarks.time_model_accuracy --quick    # 3 configurations x 10 steps, twice (a smoke run: ~3 min)
    python -m benchmarks.time_model_accuracy --runs-json runs.json   # keep the records; report on them again later

Timings depend on the machine being quiet (other jobs on the cores move a step by 2x): the load
average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


from megatron_epp.training.replay import run_pretrain
from megatron_epp.planner.config import CALIBRATE_FIRST_STEP
from megatron_epp.training.metrics import StepMetrics
from benchmarks.common import Parser, subset_of, hindsight, load_average, wiki_dataset

GOAL = 0.10
COMMON = ["--elastic-pp", "--pipeline-model-parallel-size", "2", "--lr", "3e-3", "--log-interval", "1"]
# name -> (corpus, flags): shapes, caps, corpora and builders away from calibrate_step.py's configurations
CONFIGS = {
    "stdlib-h128-cap2048-elastic": ("stdlib", ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
                                               "--seq-length", "2048", "--global-batch-size", "8"]),
    "wiki-h64-cap512-seq1f1b": ("wiki", ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                                         "--seq-length", "512", "--global-batch-size", "8", "--epp-plan", "seq1f1b",
                                         "--epp-memory-budget", "4"]),
    "mock-h64-8layers-cap2048-tight": ("mock", ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
                                                "--seq-length", "2048", "--global-batch-size", "8", "--epp-memory-budget", "0.03"]),
    "mock-h96-cap1536-megatron": ("mock", ["--num-layers", "4", "--hidden-size", "96", "--num-attention-heads", "4",
                                           "--seq-length", "1536", "--global-batch-size", "16", "--epp-plan", "megatron",
                                           "--epp-memory-budget", "4"]),
    "wiki-h128-cap1024-greedy": ("wiki", ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "8",
                                          "--seq-length", "1024", "--global-batch-size", "16", "--epp-memory-budget", "0.05",
                                          "--epp-recompute", "greedy"]),
    "stdlib-h32-cap4096-elastic": ("stdlib", ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
                                              "--seq-length", "4096", "--global-batch-size", "4", "--epp-memory-budget", "0.02"]),
}
QUICK = ("stdlib-h128-cap2048-elastic", "mock-h64-8layers-cap2048-tight", "mock-h96-cap1536-megatron")


def corpus_flags(corpus: str, cap: int, gbs: int, steps: int) -> list[str]:
    if corpus == "mock":
        return ["--mock-data"]
    if corpus == "wiki":  # the benchmark's Wikipedia-length documents (each step's scaled to reach the cap)
        return ["--data-path", wiki_dataset(cap, gbs, steps, seed=0), "--tokenizer-type", "ByteTokenizer", "--split", "1,0,0"]
    from megatron_epp.data.stdlib_corpus import ensure_stdlib_corpus

    return ["--data-path", ensure_stdlib_corpus(progress=False), "--tokenizer-type", "ByteTokenizer", "--split", "1,0,0",
            "--epp-truncate-documents"]


def errors(steps: list, calibrated: bool, name: str) -> np.ndarray:
    """|predicted / measured - 1| of the steps after the first calibration."""
    later = [s for s in steps if s.iteration > CALIBRATE_FIRST_STEP]
    if calibrated and any(s.elastic.speed_factor == 1.0 for s in later):
        raise RuntimeError(f"{name}: a step after {CALIBRATE_FIRST_STEP} was predicted without calibration")
    return np.array([abs(s.elastic.predicted_step_ms / s.elastic.measured_ms - 1) for s in later])


def step_rows(steps: list) -> list[list[float]]:
    """``[iteration, predicted/measured - 1, chunks, planning overlap ms (None in records from before it was kept),
    measured ms]`` of the steps after the first fit."""
    return [[s.iteration, s.elastic.predicted_step_ms / s.elastic.measured_ms - 1, sum(s.elastic.num_chunks.values()),
             s.elastic.planning_overlap_ms, s.elastic.measured_ms] for s in steps if s.iteration > CALIBRATE_FIRST_STEP]


def noise_floor(calibrated: list, static: list) -> np.ndarray:
    """|ratio / median ratio - 1| of the measured ms of the steps (after the first) both runs ran with plans of
    the same summary: the same step measured twice."""
    ratio = np.array([a.elastic.measured_ms / b.elastic.measured_ms for a, b in zip(calibrated, static)
                      if a.iteration > 1 and a.elastic.plan == b.elastic.plan])
    return np.abs(ratio / np.median(ratio) - 1) if len(ratio) else np.zeros(0)


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{len(QUICK)} configurations, 10 steps each")
    ap.add_argument("--iters", type=int, default=None, help="steps per run (default 30, quick 10)")
    ap.add_argument("--configs", type=subset_of(CONFIGS), default=None, help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--epp-profile", default="cpu", help="cost-model profile of every run (default cpu: the shipped one nearest each run's shape)")
    ap.add_argument("--runs-json", default=None,
                    help="save the runs' metrics records here; if the file exists, report on it instead of running again")
    args = ap.parse_args(argv)
    names = args.configs or list(QUICK if args.quick else CONFIGS)
    iters = args.iters or (10 if args.quick else 30)
    if iters <= CALIBRATE_FIRST_STEP:
        ap.error(f"--iters {iters}: needs steps after the first calibration (step {CALIBRATE_FIRST_STEP})")
    print(f"{len(names)} configurations x {iters} steps, calibrated and static; errors of steps {CALIBRATE_FIRST_STEP + 1}.."
          f"{iters}; load average {load_average():.2f}", flush=True)
    print(f"{'configuration':32s} {'chunks':>6s} {'meas ms':>8s} {'s':>6s} {'o ms':>6s} {'calibrated med/max':>19s} "
          f"{'static med/max':>15s}", flush=True)
    saved = json.loads(Path(args.runs_json).read_text()) if args.runs_json and Path(args.runs_json).exists() else None
    if saved:
        names, iters = list(saved["runs"]), saved["iters"]
        print(f"reporting on the runs saved in {args.runs_json}")
    runs = {}
    result = {}
    for name in names:
        corpus, flags = CONFIGS[name]
        value = lambda flag: int(flags[flags.index(flag) + 1])  # noqa: E731
        argv = [*COMMON, *corpus_flags(corpus, value("--seq-length"), value("--global-batch-size"), iters), *flags,
                "--train-iters", str(iters), "--epp-profile", args.epp_profile]
        if saved:
            calibrated, static = ([StepMetrics.from_dict(d) for d in saved["runs"][name][k]] for k in ("calibrated", "static"))
        else:
            calibrated, static = run_pretrain(argv), run_pretrain([*argv, "--epp-calibrate-interval", "0"])
            runs[name] = {k: [json.loads(m.to_json()) for m in v] for k, v in (("calibrated", calibrated), ("static", static))}
        cal, sta = errors(calibrated, True, name), errors(static, False, name)
        last = calibrated[-1].elastic
        chunks = np.median([sum(s.elastic.num_chunks.values()) for s in calibrated[CALIBRATE_FIRST_STEP:]])
        measured = np.median([s.elastic.measured_ms for s in calibrated[CALIBRATE_FIRST_STEP:]])
        rows, noise = step_rows(calibrated), noise_floor(calibrated, static)
        result[name] = {
            "calibrated": {"median": float(np.median(cal)), "max": float(cal.max()), "steps": len(cal)},
            "hindsight_max": float(np.abs(hindsight(rows)).max()), "per_step": rows,
            "noise": {"median": float(np.median(noise)) if len(noise) else None, "max": float(noise.max()) if len(noise) else None,
                      "over_goal": int((noise > GOAL).sum()), "pairs": len(noise)},
            "static": {"median": float(np.median(sta)), "max": float(sta.max()), "steps": len(sta)},
            "speed_factor": last.speed_factor, "stage_overhead_ms": last.stage_overhead_ms,
        }
        print(f"{name:32s} {chunks:6.0f} {measured:8.0f} {last.speed_factor:6.2f} {last.stage_overhead_ms:6.2f} "
              f"{np.median(cal):9.1%}/{cal.max():6.1%}    {np.median(sta):6.1%}/{sta.max():6.1%}", flush=True)
    if args.runs_json and not saved:
        Path(args.runs_json).write_text(json.dumps({"iters": iters, "runs": runs}) + "\n")
    misses = [(name, row, h) for name, r in result.items() for row, h in zip(r["per_step"], hindsight(r["per_step"]))
              if abs(row[1]) > GOAL]
    print(f"calibrated steps off by more than {GOAL:.0%}: {len(misses)} of {sum(len(r['per_step']) for r in result.values())}")
    for name, (it, err, chunks, overlap, measured), h in misses:
        planner = "n/a" if overlap is None else f"{overlap:.1f} ms ({overlap / measured:.0%})"
        print(f"  {name:32s} step {it:3d}: {err:+6.1%} of {measured:7.1f} ms, {chunks:3.0f} chunks, planner inside it {planner}, "
              f"{h:+6.1%} with the hindsight factor")
    worst = max(r["calibrated"]["max"] for r in result.values())
    pairs = sum(r["noise"]["pairs"] for r in result.values())
    noisy = sum(r["noise"]["over_goal"] for r in result.values())
    print(f"noise floor: {pairs} steps measured twice with plans of the same summary, {noisy} of them apart by more than "
          f"{GOAL:.0%} (" + ", ".join(f"{n} max {r['noise']['max']:.1%}" for n, r in result.items() if r["noise"]["pairs"]) + ")")
    print(f"load average {load_average():.2f}; worst calibrated step {worst:.1%} (goal <= {GOAL:.0%}): "
          f"{'met' if worst <= GOAL else 'NOT met'}")
    print(json.dumps({"goal": GOAL, "after_step": CALIBRATE_FIRST_STEP, "iters": iters, "within_goal": worst <= GOAL,
                      "configs": result}, separators=(",", ":")))


if __name__ == "__main__":
    main()
