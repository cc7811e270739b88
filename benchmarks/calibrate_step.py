#!/usr/bin/env python3
"""Calibrate the cost model's per-chunk executor overhead on real elastic steps, and check it.

Runs ``pretrain_gpt.py --elastic-pp`` (pp=2, one thread per rank, 4 layers of the shape the profile was
measured at: hidden 64, 4 heads, FFN 256 for the test model's) on plans with many small chunks and with few large ones (stdlib corpus and mock
documents; EPP at a tight and a loose budget, Megatron packing, Seq1F1B k=8), rebuilds each step's
plan in-process (checked against the logged summary; the runs do not calibrate online,
``--epp-calibrate-interval 0``, so that every step's plan is the profile's), and fits the per-chunk
stage overhead ``o`` (ms per chunk per stage, half forward, half backward) with a speed factor ``s``
(measured = s x simulated(o)) that absorbs a machine running uniformly slower or faster than the one
the layers were profiled on (``s`` is reported, not stored; ``--no-speed-factor`` fits ``o`` alone),
by the fit the training driver runs online (``megatron_epp.planner.calibration.fit_step_model``, here
without its pull toward the profile's ``o``) on ``measured ms`` of the log (``forward_backward_elastic``
on the last stage, the same span the simulator predicts). Prints predicted vs measured before (the
profile as given) and after, per configuration and per data set, with leave-one-configuration-out errors.

    python -m benchmarks.calibrate_step [--quick] [--write]   # --write stores o in the profile JSON
    python -m benchmarks.calibrate_step --check               # predicted (logged) vs measured with the profile as is

The first step of every run (warm-up) is dropped. Timings depend on the machine being quiet: the
profile records the load average seen during the runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

import numpy as np


from megatron_epp.planner.calibration import fit_step_model, simulate_steps
from megatron_epp.training.replay import reconstruct_plans, run_pretrain
from megatron_epp.cost.profile import Profile
from megatron_epp.cost.profile_lookup import TEST_MODEL_PROFILE
from megatron_epp.training.metrics import StepMetrics
from benchmarks.common import Parser, subset_of, load_average

def model_flags(profile: Path, seq_length: int) -> list[str]:
    """The runs' model: 4 layers (2 per stage) of the shape the profile's times were measured at."""
    shape = Profile.load(profile).time_model
    return ["--num-layers", "4", "--hidden-size", str(shape.hidden), "--num-attention-heads", str(shape.num_heads),
            "--ffn-hidden-size", str(shape.ffn_hidden), "--seq-length", str(seq_length), *RUN]


RUN = ["--global-batch-size", "16", "--lr", "3e-3", "--log-interval", "1", "--pipeline-model-parallel-size", "2",
         "--epp-calibrate-interval", "0"]
# name -> (data set, extra flags): many small chunks and few large ones on each data set
CONFIGS = {
    "stdlib-epp-0.1GB": ("stdlib", ["--epp-memory-budget", "0.1"]),
    "stdlib-epp": ("stdlib", ["--epp-memory-budget", "4"]),
    "stdlib-megatron": ("stdlib", ["--epp-plan", "megatron", "--epp-memory-budget", "4"]),
    "mock-seq1f1b-k8": ("mock", ["--epp-plan", "seq1f1b", "--epp-max-slices", "8", "--epp-memory-budget", "4"]),
    "mock-epp-0.02GB": ("mock", ["--epp-memory-budget", "0.02"]),
    "mock-megatron": ("mock", ["--epp-plan", "megatron", "--epp-memory-budget", "4"]),
}
QUICK = ("stdlib-epp-0.1GB", "stdlib-megatron", "mock-seq1f1b-k8", "mock-megatron")


def data_flags(kind: str) -> list[str]:
    if kind == "mock":
        return ["--mock-data"]
    from megatron_epp.data.stdlib_corpus import ensure_stdlib_corpus

    return ["--data-path", ensure_stdlib_corpus(progress=False), "--tokenizer-type", "ByteTokenizer", "--split", "1,0,0",
            "--epp-truncate-documents"]


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{len(QUICK)} configurations, 3 steps each")
    ap.add_argument("--iters", type=int, default=None, help="steps per run (default 6, quick 3); the first is dropped")
    ap.add_argument("--configs", type=subset_of(CONFIGS), default=None, help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--epp-profile", default=str(TEST_MODEL_PROFILE))
    ap.add_argument("--seq-length", type=int, default=1024, help="the runs' context cap (default 1024)")
    ap.add_argument("--write", action="store_true", help="store the fitted overhead in --epp-profile")
    ap.add_argument("--check", action="store_true", help="no fit: the logged prediction (profile as is) vs measured")
    ap.add_argument("--fwd-share", type=float, default=0.5, help="part of the per-chunk overhead put on the forward")
    ap.add_argument("--no-speed-factor", action="store_true",
                    help="fit o alone (default: also a speed factor s, measured = s x simulated, for another or a busy machine)")
    ap.add_argument("--runs-json", default=None,
                    help="save the parsed runs here; if the file exists, fit on it instead of running again")
    args = ap.parse_args(argv)
    names = args.configs or list(QUICK if args.quick else CONFIGS)
    iters = args.iters or (3 if args.quick else 6)
    tmp = Path(tempfile.mkdtemp(prefix="epp-calib-"))
    snapshot = tmp / "profile.json"  # every run and every rebuilt plan sees the same profile
    shutil.copy(args.epp_profile, snapshot)
    print(f"profile {args.epp_profile} (overhead {json.loads(snapshot.read_text()).get('overhead', {}).get('fwd_ms', 0):.3g}"
          f"+{json.loads(snapshot.read_text()).get('overhead', {}).get('bwd_ms', 0):.3g} ms/chunk/stage); "
          f"{iters} steps per run, first dropped; load average {load_average():.2f}", flush=True)
    loads = [load_average()]
    rows = []  # (config, data, plan, measured, logged predicted)
    saved = json.loads(Path(args.runs_json).read_text()) if args.runs_json and Path(args.runs_json).exists() else None
    if saved:
        snapshot.write_text(json.dumps(saved["profile"]))
        names, iters, loads = list(saved["runs"]), saved["iters"], saved["loads"]
        print(f"fitting on the runs saved in {args.runs_json} (load averages {loads})")
    model = model_flags(snapshot, args.seq_length)
    record = {"profile": json.loads(snapshot.read_text()), "iters": iters, "loads": loads, "runs": {}}
    for name in names:
        kind, extra = CONFIGS[name]
        argv = ["--elastic-pp", *data_flags(kind), *model, *extra, "--train-iters", str(iters), "--epp-profile", str(snapshot)]
        if saved:
            steps = [StepMetrics.from_dict(d) for d in saved["runs"][name]]
        else:
            steps = run_pretrain(argv)
            loads.append(load_average())
            record["runs"][name] = [json.loads(st.to_json()) for st in steps]
        plans, cost_model = (None, None) if args.check else reconstruct_plans(argv, iters)
        mismatched = 0
        for i, step in enumerate(steps[1:], start=1):
            plan = None
            if plans is not None:
                if plans[i].summary() != step.elastic.plan:
                    mismatched += 1
                    continue
                plan = plans[i].plan
            rows.append((name, kind, plan, step.elastic.measured_ms, step.elastic.predicted_step_ms, sum(step.elastic.num_chunks.values())))
        chunks = np.median([sum(s.elastic.num_chunks.values()) for s in steps[1:]])
        print(f"  ran {name:18s} {len(steps) - 1} steps, median {chunks:.0f} chunks, measured "
              f"{np.median([s.elastic.measured_ms for s in steps[1:]]):.0f} ms" + (f" ({mismatched} plans not rebuilt exactly: skipped)" if mismatched else ""),
              flush=True)
    if args.runs_json and not saved:
        Path(args.runs_json).write_text(json.dumps(record) + "\n")
    y = np.array([r[3] for r in rows])
    if args.check:
        report(rows, y, {"logged": np.array([r[4] for r in rows]) / y - 1})
        return
    plans = [r[2] for r in rows]
    speed = not args.no_speed_factor
    fit = fit_step_model(plans, y, cost_model, fwd_share=args.fwd_share, fit_speed=speed)
    # leave one configuration out: fit on the others, predict the held-out one
    loo = np.full(len(rows), np.nan)
    for name in names:
        held = np.array([r[0] == name for r in rows])
        if held.all() or not held.any():
            continue
        f = fit_step_model([p for p, h in zip(plans, held) if not h], y[~held], cost_model, fwd_share=args.fwd_share, fit_speed=speed)
        loo[held] = simulate_steps([p for p, h in zip(plans, held) if h], f.apply(cost_model)) / y[held] - 1
    print(f"\nfit: per-chunk stage overhead {fit.overhead_ms:.2f} ms (forward {fit.fwd_ms:.2f}, backward {fit.bwd_ms:.2f}, "
          f"profile ms); speed factor s = {fit.speed_factor:.2f} (measured / modelled; 1 on the machine the layers were "
          f"profiled on; not stored: the training driver fits it online)")
    errs = {"before": fit.rel_err_before, "after": fit.rel_err_after, "after (LOO)": loo}
    report(rows, y, errs)
    if args.write:
        path = Path(args.epp_profile)
        data = json.loads(path.read_text())  # re-read: only the overhead entry changes
        data["overhead"] = {
            "fwd_ms": fit.fwd_ms,
            "bwd_ms": fit.bwd_ms,
            "fit": {
                "note": "per-chunk stage overhead of the elastic executor, fitted on real pretrain_gpt.py --elastic-pp steps by benchmarks/calibrate_step.py",
                "date": datetime.date.today().isoformat(),
                "machine": f"{platform.machine()} {os.cpu_count()} cores, pp=2, 1 thread per rank, gloo",
                "load_average": [round(x, 2) for x in loads],
                "configs": {n: " ".join(CONFIGS[n][1]) + f" ({CONFIGS[n][0]})" for n in names},
                "model": " ".join(model),
                "points": len(rows),
                "mean_abs_rel_err_before": float(np.mean(np.abs(fit.rel_err_before))),
                "mean_abs_rel_err_after": float(np.mean(np.abs(fit.rel_err_after))),
                "mean_abs_rel_err_loo": float(np.nanmean(np.abs(loo))),
                "speed_factor_s": fit.speed_factor,
            },
        }
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote overhead to {path}")
    shutil.rmtree(tmp, ignore_errors=True)


def report(rows, y: np.ndarray, errs: dict[str, np.ndarray]) -> None:
    names = list(dict.fromkeys(r[0] for r in rows))
    head = "".join(f" {k + ' err':>16s}" for k in errs)
    print(f"\n{'config':18s} {'steps':>5s} {'chunks':>6s} {'meas ms':>8s}{head}   (median per config; err = predicted/measured - 1)")
    for name in names:
        sel = np.array([r[0] == name for r in rows])
        chunks = np.median([r[5] for r, s in zip(rows, sel) if s])
        print(f"{name:18s} {sel.sum():5d} {chunks:6.0f} {np.median(y[sel]):8.0f}" + "".join(f" {np.median(e[sel]):+16.1%}" for e in errs.values()))
    for kind in dict.fromkeys(r[1] for r in rows):
        sel = np.array([r[1] == kind for r in rows])
        print(f"{kind + ' mean |err|':30s}      " + "".join(f" {np.nanmean(np.abs(e[sel])):16.1%}" for e in errs.values()))
    print(f"{'all mean |err|':30s}      " + "".join(f" {np.nanmean(np.abs(e)):16.1%}" for e in errs.values()))


if __name__ == "__main__":
    main()
