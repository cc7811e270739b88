#!/usr/bin/env python3
"""--epp-recompute adaptive vs none vs full on the same batches: step time and peak activation memory.

Runs pretrain_gpt.py --elastic-pp at pp=2 (CPU, one thread per rank) once per mode on mock
variable-length documents, and prints per stage the planner's predicted and the measured peak
activation memory (medians over the steps after the first), recomputed layers and ms/step.

    python scripts/bench_recompute.py [--budget-gb 0.02] [--iters 8] [extra pretrain_gpt flags]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+).*recomputed_layers=(\d+).*act MB pred/meas per stage: ([\d./, ]+)")


def run(mode: str, budget: float, iters: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(REPO / "pretrain_gpt.py"),
           "--elastic-pp", "--mock-data", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
           "--hidden-size", "64", "--seq-length", "1024", "--global-batch-size", "16", "--lr", "5e-3",
           "--train-iters", str(iters), "--log-interval", "1", "--epp-memory-budget", str(budget),
           "--epp-recompute", mode, *extra]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    if out.returncode:
        return {"error": (out.stdout + out.stderr).strip().splitlines()[-1]}
    rows = [LINE.search(line) for line in out.stdout.splitlines()]
    rows = [r for r in rows if r][1:]  # the first step includes warm-up
    stages = [[tuple(map(float, pair.split("/"))) for pair in r.group(3).split(", ")] for r in rows]
    return {
        "ms": statistics.median(float(r.group(1)) for r in rows),
        "recomputed": statistics.median(int(r.group(2)) for r in rows),
        "pred": [statistics.median(s[p][0] for s in stages) for p in range(len(stages[0]))],
        "meas": [statistics.median(s[p][1] for s in stages) for p in range(len(stages[0]))],
        "err": max(abs(s[p][0] / s[p][1] - 1) for s in stages for p in range(len(s))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gb", type=float, default=0.02)
    ap.add_argument("--iters", type=int, default=8)
    args, extra = ap.parse_known_args()
    print(f"budget {args.budget_gb} GB per stage; medians over steps 2..{args.iters}")
    print(f"{'mode':9s} {'ms/step':>8s} {'recomputed':>10s}  {'act MB per stage (pred/meas)':30s} {'worst err':>9s}")
    for mode in ("none", "adaptive", "full"):
        r = run(mode, args.budget_gb, args.iters, extra)
        if "error" in r:
            print(f"{mode:9s} does not run: {r['error']}")
            continue
        stages = "  ".join(f"{p:.1f}/{m:.1f}" for p, m in zip(r["pred"], r["meas"]))
        print(f"{mode:9s} {r['ms']:8.1f} {r['recomputed']:10.0f}  {stages:30s} {r['err']:9.1%}")


if __name__ == "__main__":
    main()
