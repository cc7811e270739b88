"""What the benchmarks that run two configurations of ``pretrain_gpt.py`` side by side at one memory budget share
(``bench_context_parallel.py``: cp 1 against cp 2; ``bench_offload.py``: ``--epp-offload none`` against
``checkpoints``): the runs, alternating; each configuration's figures over its repeats; today's time-model accuracy,
read from its committed log."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from megatron_epp.planner.config import CALIBRATE_FIRST_STEP
from megatron_epp.training.metrics import StepMetrics
from megatron_epp.planner.builders import ELASTIC
from benchmarks.common import (REPO, Parser, fail, hindsight, noise_floor, paired_ratio, pipe_ms, plan_steps, planned_batches,
                               step_matrix)

ACCURACY_LOG = REPO / "docs" / "measurements" / "2026-11-24-cpu" / "time_model_accuracy_fc6a2b3.log"
MB = 2**20


def today_accuracy(path: Path) -> dict:
    """The committed time-model figures: the largest per-configuration median calibrated error and the worst
    calibrated step of ``time_model_accuracy.py``'s JSON line in ``path``."""
    try:
        last = json.loads(path.read_text().strip().splitlines()[-1])
        configs = last["configs"].values()
        return {"log": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
                "median_max": max(c["calibrated"]["median"] for c in configs),
                "worst_step": max(c["calibrated"]["max"] for c in configs), "goal": last["goal"]}
    except (OSError, ValueError, KeyError, IndexError) as error:
        fail(f"--accuracy-log {path}: not a time_model_accuracy.py log ending in its JSON line ({error})")


def prediction_errors(runs: Sequence[Sequence[StepMetrics]]) -> np.ndarray:
    """``|predicted / measured - 1|`` of every step after the first calibration, of every repeat."""
    return np.array([abs(s.elastic.predicted_step_ms / s.elastic.measured_ms - 1)
                     for r in runs for s in r if s.iteration > CALIBRATE_FIRST_STEP])


def summarize(runs: Sequence[Sequence[StepMetrics]], budget_gb: float) -> dict:
    """One configuration's figures from its repeats (every step of each run, the warm-up first)."""
    first = runs[0][0]
    rec = [[s.elastic.recomputed_layers for s in r] for r in runs]
    pred = np.array([s.elastic.predicted_activation_bytes for r in runs for s in r], dtype=float)
    meas = np.array([s.elastic.measured_activation_bytes for r in runs for s in r], dtype=float)
    states = np.array([s.elastic.model_state_bytes for r in runs for s in r], dtype=float)
    err = prediction_errors(runs)
    # every step after the first calibration: [repeat, iteration, predicted / measured - 1, predicted ms, measured ms]
    rows = [[i, s.iteration, s.elastic.predicted_step_ms / s.elastic.measured_ms - 1, s.elastic.predicted_step_ms,
             s.elastic.measured_ms] for i, r in enumerate(runs) for s in r if s.iteration > CALIBRATE_FIRST_STEP]
    left = np.abs(hindsight([row[1:] for row in rows])) if rows else np.zeros(0)
    host = [(s.elastic.predicted_host_bytes, s.elastic.measured_host_bytes) for r in runs for s in r
            if s.elastic.predicted_host_bytes is not None]
    measured = [r[1:] for r in runs]  # the warm-up dropped
    plans = [[s.elastic.plan for s in r] for r in runs]
    return {
        "recomputed": rec, "recomputed_totals": [int(sum(r)) for r in rec],
        "act_pred_mb": (pred.max(0) / MB).tolist(), "act_meas_mb": (meas.max(0) / MB).tolist(),
        "act_worst_err": float(np.abs(pred / meas - 1).max()), "states_mb": (states.max(0) / MB).tolist(),
        # cp > 1: each CP rank's peak per stage ([stage][cp rank], over the steps)
        "act_meas_cp_mb": None if first.elastic.measured_cp_activation_bytes is None else
        (np.max([s.elastic.measured_cp_activation_bytes for r in runs for s in r], axis=0) / MB).tolist(),
        "fits": bool(((states + meas) <= budget_gb * 2**30).all()),
        "pred_err_median": float(np.median(err)) if len(err) else None, "pred_err_max": float(err.max()) if len(err) else None,
        "pred_err_steps": len(err), "hindsight_median": float(np.median(left)) if len(left) else None,
        "hindsight_max": float(left.max()) if len(left) else None, "per_step": rows,
        "measured_ms": float(np.median(step_matrix(measured, pipe_ms))),
        "predicted_ms": float(np.median([s.elastic.predicted_step_ms for r in runs for s in r if s.iteration > CALIBRATE_FIRST_STEP]
                                        or [np.nan])),
        "noise": noise_floor(step_matrix(measured, pipe_ms)),
        # the calibration each run ended with: speed factor s (measured / profile ms) and per-chunk overhead o (profile ms)
        "speed_factor": [r[-1].elastic.speed_factor for r in runs], "stage_overhead_ms": [r[-1].elastic.stage_overhead_ms for r in runs],
        "plans_differ": sum(len({p[i] for p in plans}) > 1 for i in range(min(map(len, plans)))),
        "repeats": len(runs),
        # activation offload (--epp-offload): checkpoints in host memory per step, per repeat; per stage the host bytes
        # predicted and measured (the largest over the steps that offload) and whether they agree on every such step
        "offloaded": [[s.elastic.offloaded_layers for s in r] for r in runs],
        "host_pred_mb": (np.max([p for p, _ in host], axis=0) / MB).tolist() if host else None,
        "host_meas_mb": (np.max([m for _, m in host], axis=0) / MB).tolist() if host else None,
        "host_steps": len(host), "host_exact": all(p == m for p, m in host) if host else None,
    }


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def same_batches(argvs: dict, world_sizes: dict, iters: int, cap: int) -> tuple[list, dict]:
    """The global batches both configurations' runs train (``planned_batches`` of each one's flags on its world size;
    one line if they differ) and each one's planner, by name; the batches printed in one line."""
    planned = {name: planned_batches(argv, iters, world_size=world_sizes[name]) for name, argv in argvs.items()}
    first, *others = planned.values()
    batches = first[0]
    if any(p[0] != batches for p in others):
        fail("the configurations would train different batches (the sampler differs between the launches)")
    lengths = np.concatenate(batches)
    print(f"  batches: tokens per step {[int(sum(b)) for b in batches]} (first: warm-up), lengths p50 {np.median(lengths):.0f} "
          f"max {lengths.max()}, {int(np.sum(lengths == cap))} at the cap", flush=True)
    return batches, {name: p[1] for name, p in planned.items()}


def paired_ratios(base: Sequence[Sequence[StepMetrics]], other: Sequence[Sequence[StepMetrics]]) -> tuple[float, float]:
    """``other / base`` step time paired by step: measured over the steps after the warm-up (a step's time its median over
    the repeats), and the runs' calibrated predictions over the steps after the first calibration."""
    measured = paired_ratio(*(step_matrix([r[1:] for r in runs], pipe_ms) for runs in (other, base)))  # its first over its second
    later = [[[s for s in r if s.iteration > CALIBRATE_FIRST_STEP] for r in runs] for runs in (other, base)]
    predicted = paired_ratio(*(step_matrix(runs, lambda s: s.elastic.predicted_step_ms) for runs in later))
    return measured, predicted


def plan_facts(batches, builds: dict, budget_gb: float) -> dict:
    """Each configuration's elastic plans of ``batches`` at ``budget_gb`` (None: it cannot run there), by the name of
    its planner in ``builds``."""
    return {name: plan_steps(ELASTIC, batches, b.cost_model, b.config, budget_gb) for name, b in builds.items()}


def alternating_runs(names: Sequence[str], argvs: dict[str, list[str]], nprocs: dict[str, int], budget_gb: float, repeats: int,
                     expected_tokens: list[int], failed: dict[str, str]) -> dict[str, list[list[StepMetrics]]]:
    """``repeats`` rounds of one launch per configuration (``pretrain_gpt.py`` with ``argvs[name]`` and the budget, on
    ``nprocs[name]`` processes), the order swapped every round to spread drift over both; a run that fails, or trains
    other tokens per step than ``expected_tokens``, is recorded in ``failed`` (a configuration already there is skipped)."""
    from megatron_epp.training.replay import run_pretrain

    runs: dict[str, list[list[StepMetrics]]] = {name: [] for name in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            if name in failed:
                continue
            t1 = time.perf_counter()
            try:
                steps = run_pretrain([*argvs[name], "--epp-memory-budget", repr(budget_gb)], nproc=nprocs[name])
            except RuntimeError as error:
                failed[name] = str(error)
                print(f"  repeat {r + 1}/{repeats} {name}: FAILED: {error}", flush=True)
                continue
            if [int(s.tokens) for s in steps] != expected_tokens:
                failed[name] = f"tokens per step {[s.tokens for s in steps]} differ from the planned batches' {expected_tokens}"
                print(f"  repeat {r + 1}/{repeats} {name}: {failed[name]}", flush=True)
                continue
            runs[name].append(steps)
            print(f"  repeat {r + 1}/{repeats} {name}: {time.perf_counter() - t1:.1f} s, measured ms per step "
                  + " ".join(f"{s.elastic.measured_ms:.0f}" for s in steps), flush=True)
    return runs


def run_parser(doc: str, num_layers: int, heads_help: str = "") -> Parser:
    """The command line both benchmarks share: the runs (``--repeats``, ``--iters``), the model and data
    (``--seq-length``, ``--global-batch-size``, ``--num-layers`` defaulting to ``num_layers``, ``--hidden-size``,
    ``--num-attention-heads``, ``--seed``), the budget, today's accuracy log, ``--simulate-only``."""
    ap = Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--simulate-only", action="store_true", help="the budget and the plans only, no training")
    ap.add_argument("--repeats", type=int, default=3, help="launches per configuration (default 3)")
    ap.add_argument("--iters", type=int, default=10, help=f"steps per launch, the first a warm-up (default 10; > {CALIBRATE_FIRST_STEP})")
    ap.add_argument("--seq-length", type=int, default=2048, help="context cap (default 2048)")
    ap.add_argument("--global-batch-size", type=int, default=4, help="documents per step (default 4)")
    ap.add_argument("--num-layers", type=int, default=num_layers, help=f"(default {num_layers})")
    ap.add_argument("--hidden-size", type=int, default=64, help="(default 64; FFN 4x)")
    ap.add_argument("--num-attention-heads", type=int, default=4, help=f"(default 4{heads_help})")
    ap.add_argument("--seed", type=int, default=1234, help="data order and lengths (default 1234)")
    ap.add_argument("--epp-memory-budget", type=float, default=None, help="GB per rank (default: chosen by the planner)")
    ap.add_argument("--accuracy-log", type=Path, default=ACCURACY_LOG, help="the time_model_accuracy.py log of today's accuracy")
    return ap


def check_run_args(args: argparse.Namespace) -> None:
    """:func:`run_parser`'s values, each bad one a one-line error."""
    for flag in ("repeats", "global_batch_size", "num_layers", "hidden_size", "num_attention_heads"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be >= 1")
    if args.iters <= CALIBRATE_FIRST_STEP:
        fail(f"--iters {args.iters}: needs steps after the first calibration (step {CALIBRATE_FIRST_STEP})")
    if args.seq_length < 2:
        fail("--seq-length must be >= 2")
    if args.epp_memory_budget is not None and args.epp_memory_budget <= 0:
        fail("--epp-memory-budget must be positive")
