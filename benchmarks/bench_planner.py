"""Planner benchmark: solve time (one core) and predicted step time of EPP versus every baseline.

1. Planning time: the elastic builder (``plan_batch``: EPP's search, its finalists' recompute and
   simulation, and the Megatron / Seq1F1B candidates it weighs) for ``--timing-sequences`` (2048:
   about 2M tokens) sequences sampled from the Wikipedia lengths (cap 128K, P = 4, LLaMA-13B analytic
   H100 profile, TP = 8), at the memory budget and at 20 GB where the ILP has work to do; one
   batch per seed. Reports the process's CPU time (what one core costs when other processes share
   the machine; ``--cpu N`` pins the process to core N) and wall time: median, p90, max, and the
   spread (max / min) as the noise.
   ``--scale-test``: also ``tests/integration/test_planner_scale.py``'s heavy-tailed batch (2048 log-normal
   lengths, median 3.2K, sigma 1.9, cap 64K: 22M tokens) at 80 / 40 / 20 GB. ``--layout-search``: also
   the layout search on (``search_layout`` for EPP, 2048 Wikipedia sequences, the 32-GPU
   ``a800-ib-node`` cluster, 80 GB), ``--layout-seeds`` batches (goal: under 10 s).
2. Comparison: for Wikipedia and a heavier-tailed code-like mix, at 32K/64K/128K caps, the
   predicted step time of EPP and of each baseline, as ratios to EPP and to the compute bound.

    python -m benchmarks.bench_planner [--network fat-tree] [--seeds 3] [--cpu 0]

The last line is one JSON object: ``{"planning": {"<GB>": {"cpu_ms": {...}, "wall_ms": {...}}},
"comparison": [{"data", "cap", "epp_ms", "bound_ms", "<system>": step / EPP step}, ...]}``.
"""

from __future__ import annotations

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

import argparse
import json
import statistics
import time

import numpy as np


from megatron_epp.cost.model import CostModel
from megatron_epp.cost.network import get_network
from megatron_epp.cost.clusters import get_cluster
from megatron_epp.base.units import GIB
from megatron_epp.cost.profile_lookup import load_profile
from megatron_epp.cost.shape import MODEL_PRESETS
from megatron_epp.planner.layout import search_layout
from megatron_epp.planner import build_plan
from megatron_epp.planner.builders import ELASTIC, plan_batch
from megatron_epp.planner.compare import BASELINES, run_baselines
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.data.mock_documents import WIKIPEDIA_LENGTHS
from megatron_epp.data.lengths import read_lengths
from benchmarks.common import Parser



def code_like(n: int, rng: np.random.Generator) -> np.ndarray:
    """Heavier-tailed than Wikipedia: log-normal body (median 1.5K) and a 4 % Pareto tail from 16K
    (alpha 1.1), so that about a fifth of the tokens sit in documents over 64K (cf. ByteScale's
    16 % of GitHub tokens over 128K)."""
    body = rng.lognormal(np.log(1500), 1.3, n)
    tail = 16384 * (1 + rng.pareto(1.1, n))
    return np.maximum(np.where(rng.random(n) < 0.04, tail, body), 1).astype(np.int64)


def solve_times(pool: np.ndarray, cm: CostModel, config: PlannerConfig, n: int, seeds: int) -> tuple[list[float], list[float], float, int]:
    """Wall and CPU ms of ``plan_batch`` per seed (``n`` sequences each), the largest MIP gap,
    recomputed layers in all."""
    wall, cpu, gap, recomputed = [], [], 0.0, 0
    for seed in range(seeds):
        lengths = np.minimum(np.random.default_rng(seed).choice(pool, n), config.max_seq_len)
        t0, c0 = time.perf_counter(), time.process_time()
        plan = plan_batch(lengths, cm, config)
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
        gap = max(gap, plan.report.mip_gap or 0.0)
        recomputed += plan.report.recomputed_layers
    return wall, cpu, gap, recomputed


def spread(ms: list[float]) -> dict:
    return {"median": round(statistics.median(ms), 1), "p90": round(float(np.percentile(ms, 90)), 1),
            "max": round(max(ms), 1), "max_over_min": round(max(ms) / min(ms), 2)}


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--network", default="fat-tree")
    ap.add_argument("--epp-profile", default="llama-13b", help="cost-model profile (as epp-plan's)")
    ap.add_argument("--epp-memory-budget", type=float, default=80.0, help="GB per GPU (as epp-plan's)")
    ap.add_argument("--seeds", type=int, default=3, help="batches averaged per comparison cell")
    ap.add_argument("--timing-seeds", type=int, default=11)
    ap.add_argument("--timing-sequences", type=int, default=2048, help="sequences per timed batch")
    ap.add_argument("--timing-only", action="store_true", help="skip the comparison (part 2)")
    ap.add_argument("--cpu", type=int, help="pin the process to this core (as taskset -c)")
    ap.add_argument("--scale-test", action="store_true", help="also time the heavy-tailed batch of tests/integration/test_planner_scale.py")
    ap.add_argument("--layout-search", action="store_true", help="also time the layout search (EPP, 32 A800 GPUs)")
    ap.add_argument("--layout-seeds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    cm = CostModel(load_profile(args.epp_profile, 8), 4, network=get_network(args.network))
    wiki = read_lengths(WIKIPEDIA_LENGTHS)

    n = args.timing_sequences
    print(f"== planning time: {n} Wikipedia sequences, cap 128K, P=4, {args.epp_profile} TP=8, one core, {args.timing_seeds} batches ==")
    planning = {}
    for mem in (args.epp_memory_budget, 20.0):
        config = PlannerConfig(mem * GIB, 131072, args.epp_profile)
        wall, cpu, gap, rc = solve_times(wiki, cm, config, n, args.timing_seeds)
        planning[f"{mem:g}"] = {"cpu_ms": spread(cpu), "wall_ms": spread(wall)}
        print(f"  {mem:5.0f} GB: CPU median {statistics.median(cpu):6.1f} ms  p90 {np.percentile(cpu, 90):6.1f} ms  max {max(cpu):6.1f} ms "
              f"(max/min {max(cpu) / min(cpu):.2f}) | wall median {statistics.median(wall):6.1f} ms  max {max(wall):6.1f} ms  "
              f"(largest MIP gap {gap:.2%}, {rc / len(wall):.0f} recomputed layers per plan)")

    if args.scale_test:
        lengths = np.clip(np.rint(np.random.default_rng(0).lognormal(np.log(3200), 1.9, n)), 2, 65536).astype(np.int64)
        for mem in (80.0, 40.0, 20.0):
            c0 = time.process_time()
            plan_batch(lengths, cm, PlannerConfig(mem * GIB, 65536, args.epp_profile))
            cpu = (time.process_time() - c0) * 1e3
            planning[f"scale-test/{mem:g}"] = {"cpu_ms": spread([cpu])}
            print(f"  heavy-tailed {n} sequences ({lengths.sum() / 1e6:.1f}M tokens), cap 64K, {mem:5.0f} GB: CPU {cpu:8.1f} ms")
    if args.layout_search:
        shape, cluster = MODEL_PRESETS[args.epp_profile], get_cluster("a800-ib-node")
        cpu = []
        for seed in range(args.layout_seeds):
            lengths = np.minimum(np.random.default_rng(seed).choice(wiki, n), 131072)
            c0 = time.process_time()
            choice = search_layout(lengths, shape, cluster, ELASTIC, PlannerConfig(args.epp_memory_budget * GIB, 131072, args.epp_profile))
            cpu.append((time.process_time() - c0) * 1e3)
            print(f"  layout search, {n} Wikipedia sequences, {cluster.name}: CPU {cpu[-1]:8.1f} ms ({choice.reason})")
        planning["layout-search"] = {"cpu_ms": spread(cpu)}

    comparison = []
    pools = {} if args.timing_only else {"wikipedia": wiki, "code-like": code_like(1_000_000, np.random.default_rng(12345))}
    names = ("epp",) + BASELINES
    print(f"\n== predicted step time, GBS 512, P=4, TP=8, {args.epp_memory_budget:.0f} GB, network {args.network}; mean of {args.seeds} batches ==")
    print("   ratios: step / EPP step (>1: EPP faster) | step / compute bound")
    for data, pool in pools.items():
        for cap in (32768, 65536, 131072):
            rows = {n: [] for n in names}
            bound = []
            for seed in range(args.seeds):
                lengths = np.minimum(np.random.default_rng(seed).choice(pool, 512), cap)
                plan = build_plan(lengths, cm, args.epp_memory_budget * GIB)
                rows["epp"].append(plan.report.predicted_step_ms)
                bound.append(plan.report.bound_step_ms)
                for n, r in run_baselines(lengths, cm, PlannerConfig(args.epp_memory_budget * GIB, cap, args.epp_profile)).items():
                    rows[n].append(r["predicted_step_ms"] if r["fits"] else np.nan)
            epp, b = np.mean(rows["epp"]), np.mean(bound)
            cells = []
            for n in names:
                v = np.mean(rows[n])
                cells.append(f"{n} {'OOM':>11s}" if np.isnan(v) else f"{n} {v / epp:4.2f}|{v / b:4.2f}")
            print(f"  {data:9s} {cap // 1024:3d}K  EPP {epp:8.0f} ms  bound {b:8.0f} ms\n     " + "  ".join(cells[1:]))
            comparison.append({"data": data, "cap": cap, "epp_ms": round(float(epp), 1), "bound_ms": round(float(b), 1),
                               **{k: (None if np.isnan(np.mean(rows[k])) else round(float(np.mean(rows[k]) / epp), 3)) for k in names[1:]}})
    print(json.dumps({"planning": planning, "comparison": comparison}))


if __name__ == "__main__":
    main()
