#!/usr/bin/env python3
"""--epp-recompute adaptive vs none vs full on the same batches: step time and peak activation memory.

Runs pretrain_gpt.py --elastic-pp at pp=2 (CPU, one thread per rank) once per mode on mock
variable-length documents, and prints per stage the planner's predicted and the measured peak
activation memory (medians over the steps after the first), recomputed layers and ms/step. ``none``
is run at ``--epp-memory-budget`` (where it is expected not to fit) and again at ``--none-epp-memory-budget``.

Checks, each printed ``ok`` or ``FAIL``:
  * every step, every stage: |predicted / measured - 1| <= ``--tolerance`` (default 0: byte for byte, as
    ``tests/integration/test_planner_memory.py`` holds the count on CPU; the records carry bytes, not the log's rounded MB);
  * every step, every stage: model states + measured activations <= the budget the plan was made for
    (up to the log's rounding of activation MB to two decimals);
  * ``full`` measures the least activation memory of the modes at ``--epp-memory-budget``; its time is shown
    beside the others' (on CPU per-chunk overhead can make it no slower: reported, not checked).

    python -m benchmarks.bench_recompute [--hidden-size 64] [--epp-memory-budget 0.02] [--none-epp-memory-budget 0.05]
        [--iters 8] [extra pretrain_gpt flags]
"""

from __future__ import annotations

import argparse
import statistics
import sys


from megatron_epp.training.replay import parsed_config, run_pretrain
from benchmarks.common import Parser
MB = 2**20
ROUNDING = 0.005  # MB: the log prints activation MB with two decimals


def flags(hidden: int, budget: float, mode: str, iters: int, extra: list[str]) -> list[str]:
    return ["--elastic-pp", "--mock-data", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
            "--hidden-size", str(hidden), "--seq-length", "1024", "--global-batch-size", "16", "--lr", "5e-3",
            "--train-iters", str(iters), "--log-interval", "1", "--epp-memory-budget", str(budget),
            "--epp-recompute", mode, *extra]


def state_mb(argv: list[str]) -> list[float]:
    """Model states per stage (MB) as the planner counts them for this run's flags."""
    from megatron_epp.training.planning import online_planner

    return (online_planner(parsed_config(argv)).cost_model.model_state_bytes() / MB).tolist()


def run(hidden: int, mode: str, budget: float, iters: int, extra: list[str]) -> dict:
    argv = flags(hidden, budget, mode, iters, extra)
    try:
        steps = run_pretrain(argv)[1:]  # the first step includes warm-up
    except RuntimeError as error:
        return {"error": str(error)}
    pred = [[b / MB for b in s.elastic.predicted_activation_bytes] for s in steps]
    meas = [[b / MB for b in s.elastic.measured_activation_bytes] for s in steps]
    P = len(meas[0])
    states = state_mb(argv)
    return {
        "budget": budget,
        "ms": statistics.median(s.iter_ms for s in steps),
        "recomputed": statistics.median(s.elastic.recomputed_layers for s in steps),
        "pred": [statistics.median(s[p] for s in pred) for p in range(P)],
        "meas": [statistics.median(s[p] for s in meas) for p in range(P)],
        "max_meas": [max(s[p] for s in meas) for p in range(P)],
        "err": max(abs(a[p] / b[p] - 1) for a, b in zip(pred, meas) for p in range(P)),
        "total": max(states[p] + s[p] for s in meas for p in range(P)),
    }


def verdict(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--epp-memory-budget", type=float, default=0.02)
    ap.add_argument("--none-epp-memory-budget", type=float, default=0.05, help="a budget where --epp-recompute none fits")
    ap.add_argument("--tolerance", type=float, default=0.0, help="relative error allowed per step and stage (default 0: exact)")
    ap.add_argument("--iters", type=int, default=8)
    args, extra = ap.parse_known_args(argv)
    tol = args.tolerance
    print(f"hidden {args.hidden_size}, pp=2, 4 layers, seq 1024, 16 documents; medians over steps 2..{args.iters}; "
          f"checks on every step: |pred/meas - 1| <= {tol:g}, states + measured <= budget")
    print(f"{'mode':9s} {'budget GB':>9s} {'ms/step':>8s} {'rc layers':>9s}  {'act MB per stage (pred/meas)':28s} "
          f"{'worst err':>9s} {'':4s} {'peak+states MB':>14s}")
    results = {}
    failed = False
    runs = [("none", args.epp_memory_budget), ("none", args.none_epp_memory_budget), ("adaptive", args.epp_memory_budget), ("full", args.epp_memory_budget)]
    for mode, budget in runs:
        r = run(args.hidden_size, mode, budget, args.iters, extra)
        if "error" in r:
            print(f"{mode:9s} {budget:9.3f} does not run: {r['error'].split('error: ')[-1][:150]}")
            continue
        results[mode, budget] = r
        stages = "  ".join(f"{p:.1f}/{m:.1f}" for p, m in zip(r["pred"], r["meas"]))
        fits = r["total"] <= budget * 1024 + ROUNDING
        failed |= r["err"] > tol or not fits
        print(f"{mode:9s} {budget:9.3f} {r['ms']:8.1f} {r['recomputed']:9.0f}  {stages:28s} {r['err']:9.1%} "
              f"{verdict(r['err'] <= tol):4s} {r['total']:8.1f} {verdict(fits):4s}")
    at = {m: r for (m, b), r in results.items() if b == args.epp_memory_budget}
    if "none" not in at and ("adaptive" in at or "full" in at):
        print(f"none does not fit {args.epp_memory_budget} GB (refused before training); adaptive and full do: expected")
    if "full" in at:
        least = all(max(at["full"]["max_meas"]) <= max(r["max_meas"]) for r in results.values())
        slowest = all(at["full"]["ms"] >= r["ms"] for r in at.values())
        failed |= not least
        print(f"full measures the least activation memory: {verdict(least)}; the most time at {args.epp_memory_budget} GB: "
              f"{'yes' if slowest else 'no'} (" + ", ".join(f"{m} {r['ms']:.0f} ms" for m, r in at.items()) + ")")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
