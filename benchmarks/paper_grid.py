"""InfiniPipe's evaluation grid on the cost model: EPP against FlexSP, Seq1F1B and Megatron, each
system on its best parallel layout for the cluster (:mod:`megatron_epp.planner.layout`).

Grid: 32 GPUs (4 nodes x 8, A800 SXM4 80 GB, the paper's machines) with "400 Gb/s InfiniBand" read
per node (``a800-ib-node``, 6.25 GB/s per GPU) and per GPU (``a800-ib-gpu``, 50 GB/s); LLaMA
7B / 13B / 30B; contexts 48K and 96K (the paper's) plus 128K; global batch 512 documents;
CommonCrawl-like and GitHub-like lengths (the paper's data sets, synthetic here: see
:func:`length_pool`) plus a held-out heavy-tailed code distribution (p99 ~264K, max 772K). A document
longer than the context is truncated to it. Per cell: each system's predicted step time and layout,
peak memory per GPU and recompute; EPP over its compute-only bound; where a baseline is faster, the
cost term that makes it so. Ratios are baseline / EPP (> 1: EPP faster).

    python -m benchmarks.paper_grid             # the whole grid; writes the table into docs/measurements/paper-grid.md
    python -m benchmarks.paper_grid --quick     # one small cell, for the tests (no file written)
    python -m benchmarks.paper_grid --cells grid.jsonl   # each finished cell appended there; a re-run resumes

With ``--cells FILE`` each cell is appended to FILE (one JSON line) as soon as it is done, and the cells
already in FILE (same data, model, cap, cluster, gbs, memory, overlap and seed) are read back instead of
run again: a long grid can be stopped and resumed, and ``--report-only`` writes the table of the cells
done so far. Stopped by SIGTERM (``timeout 300 python -m benchmarks.paper_grid ...``), the run still writes the
table of the cells done (the others "not run yet"). The cells start most work first (:func:`work`).

The last line is one JSON object: ``{"cells": [{"data", "model", "cap", "cluster", "epp_ms",
"flexsp", "seq1f1b", "megatron", "bound"}, ...], "headline": {...}}`` (ratios to EPP; null where a
system does not fit).
"""

from __future__ import annotations

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

import json
import math
import multiprocessing
import signal
import sys
import time
from pathlib import Path

import numpy as np


from megatron_epp.cost.clusters import CLUSTERS, COMM_OVERLAP, get_cluster
from megatron_epp.base.units import GIB
from megatron_epp.cost.analytic import analytic_profile
from megatron_epp.cost.shape import MODEL_PRESETS
from megatron_epp.plan import PlanInfeasible
from megatron_epp.planner.builders import ELASTIC, MEGATRON, SEQ1F1B
from megatron_epp.planner.cli import solver_output_to_stderr
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.planner.layout import search_layout
from megatron_epp.simulator.flexsp import simulate_flexsp
from benchmarks.common import LENGTH_POOLS, REPO, Parser, batch, length_pool, subset_of, positive_ints

PAPER_RATIOS = {"flexsp": 1.69, "seq1f1b": 1.40, "megatron": 2.60}  # InfiniPipe's reported speedups of EPP
PAPER_DATA = ("commoncrawl", "github")
PAPER_CAPS = (49152, 98304)
README_BEGIN, README_END = "<!-- paper-grid:begin -->", "<!-- paper-grid:end -->"


def run_cell(data: str, lengths: np.ndarray, model: str, cap: int, cluster_name: str, memory_gb: float, overlap: float,
             flexsp_time_limit: float, exhaustive: bool) -> dict:
    shape, cluster = MODEL_PRESETS[model], get_cluster(cluster_name)
    config = PlannerConfig(memory_budget_bytes=memory_gb * GIB, max_seq_len=cap, profile=model)
    cell: dict = {"data": data, "model": model, "cap": cap, "cluster": cluster_name, "systems": {}}
    for builder in (ELASTIC, MEGATRON, SEQ1F1B):
        system = builder.plan_name  # the JSON's key: epp, megatron, seq1f1b
        t0 = time.perf_counter()
        try:
            ch = search_layout(lengths, shape, cluster, builder, config, overlap=overlap, exhaustive=exhaustive)
        except PlanInfeasible as e:
            cell["systems"][system] = {"fits": False, "reason": str(e)}
            continue
        b = ch.best
        stats = [p.report for p in b.plans]
        cell["systems"][system] = {
            "fits": True, "step_ms": b.step_ms, "layout": str(b.layout), "detail": b.detail, "bound_ms": b.bound_ms,
            "peak_gb": b.peak_memory_bytes / GIB, "recomputed_layers": b.recomputed_layers, "sync_ms": b.sync_ms,
            "bubble": max(s.bubble_ratio for s in stats), "recompute_ms": max(s.recompute_ms for s in stats),
            "why": ch.reason, "search_s": time.perf_counter() - t0,
            "tp_best_planned_ms": min((r.step_ms for r in ch.evaluated if r.layout.cp == 1), default=None),
        }
    t0 = time.perf_counter()
    try:
        f = simulate_flexsp(lengths, analytic_profile(shape, 1, cluster.accelerator), cluster.world_size, cluster, memory_gb * GIB,
                            overlap=overlap, time_limit=flexsp_time_limit)
        groups = sorted({max(g) for g in f["sp_groups"]})
        cell["systems"]["flexsp"] = {
            "fits": True, "step_ms": f["predicted_step_ms"], "peak_gb": f["peak_memory_bytes"][0] / GIB,
            "layout": f"ZeRO-3, {f['micro_batches']} mb, SP groups up to {groups[-1]}", "detail": f"recompute {f['recompute']}",
            "zero3_ms": f["zero3_exposed_ms"], "recompute_ms": f["recompute_ms"], "search_s": time.perf_counter() - t0,
        }
    except PlanInfeasible as e:
        cell["systems"]["flexsp"] = {"fits": False, "reason": str(e)}
    return cell


def _run_job(job: tuple) -> dict:
    return run_cell(*job)


class Stopped(Exception):
    """SIGTERM (e.g. ``timeout``) while the cells run: the table of the cells done is still written."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def _worker_signals() -> None:
    """A worker dies at SIGTERM (the main process stops the pool) and leaves Ctrl-C to the main process."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def work(job: tuple) -> float:
    """A cell's compute (linear layers' tokens x parameters + attention's squared lengths, per layer): the order
    the cells start in, most first, so that with ``--jobs`` the long searches run side by side from the start."""
    lengths, shape = job[1].astype(np.float64), MODEL_PRESETS[job[2]]
    return shape.num_layers * shape.hidden * (12.0 * shape.hidden * lengths.sum() + (lengths ** 2).sum())


BOUND_GAP = 1.15  # EPP further than this above its bound gets its reason in one line


def why_far_from_bound(cell: dict) -> str:
    """Which term puts EPP's step more than :data:`BOUND_GAP` above its compute-only bound (one line)."""
    e = cell["systems"]["epp"]
    bubble, rc = e["bubble"] * e["step_ms"], e["recompute_ms"]
    rest = e["step_ms"] - e["bound_ms"] - bubble - rc  # per-chunk constants, TP/SP communication the bound leaves out
    terms = {"pipeline bubbles": bubble, "recompute": rc, "per-chunk constants and communication outside the bound": rest}
    worst = max(terms, key=terms.get)
    return (f"EPP {e['step_ms'] / 1e3:.1f} s = {e['step_ms'] / e['bound_ms']:.2f}x its bound {e['bound_ms'] / 1e3:.1f} s on {e['layout']}: "
            + ", ".join(f"{k} {v / 1e3:.1f} s" for k, v in sorted(terms.items(), key=lambda kv: -kv[1])) + f" (mostly {worst})")


def why_baseline_wins(cell: dict, name: str) -> str:
    """The cost term that makes a baseline faster than EPP (one line)."""
    e, b = cell["systems"]["epp"], cell["systems"][name]
    epp_terms = {"pipeline bubbles": e["bubble"] * e["step_ms"], "recompute": e["recompute_ms"], "DP gradient sync": e["sync_ms"],
                 "compute-only bound (TP/SP communication included)": e["bound_ms"] - e["sync_ms"]}
    if name == "flexsp":
        worst = max(epp_terms, key=epp_terms.get)
        return (f"FlexSP {b['step_ms']:.0f} ms < EPP {e['step_ms']:.0f} ms: EPP's {worst} ({epp_terms[worst]:.0f} ms) exceeds what "
                f"FlexSP pays in exposed ZeRO-3 ({b['zero3_ms']:.0f} ms) and recompute ({b['recompute_ms']:.0f} ms)")
    return (f"{name} {b['step_ms']:.0f} ms on {b['layout']} < EPP {e['step_ms']:.0f} ms on {e['layout']}: the layout search's "
            "proxy ranking left the baseline's layout out of EPP's planned set")


def ratios(cell: dict) -> dict:
    e = cell["systems"]["epp"]
    out = {k: cell[k] for k in ("data", "model", "cap", "cluster")}
    out["epp_ms"] = round(e["step_ms"], 1) if e["fits"] else None
    for name in ("flexsp", "seq1f1b", "megatron"):
        b = cell["systems"][name]
        out[name] = round(b["step_ms"] / e["step_ms"], 3) if e["fits"] and b["fits"] else None
    out["bound"] = round(e["bound_ms"] / e["step_ms"], 3) if e["fits"] else None
    return out


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x]
    return float(math.exp(np.mean(np.log(xs)))) if xs else None


def headline(rows: list[dict], clusters: list[str]) -> dict:
    """Per IB reading, over the paper's cells (CommonCrawl/GitHub-like, 48K/96K, three models): the
    geometric mean and the maximum of each baseline / EPP, against the paper's figure."""
    out = {}
    for cl in clusters:
        sel = [r for r in rows if r["cluster"] == cl and r["data"] in PAPER_DATA and r["cap"] in PAPER_CAPS]
        out[cl] = {}
        for name, paper in PAPER_RATIOS.items():
            vals = [r[name] for r in sel if r[name]]
            g = geomean(vals)
            out[cl][name] = {"geomean": round(g, 3) if g else None, "max": round(max(vals), 3) if vals else None, "paper": paper,
                             "within_20pct": bool(g and abs(g / paper - 1) <= 0.2)}
    return out


def table(cells: list[dict]) -> str:
    def sys_cell(s: dict, epp_ms: float) -> str:
        if not s["fits"]:
            return "does not fit"
        extra = f" {s['detail']}" if s.get("detail") else ""
        return f"{s['step_ms'] / 1e3:.1f} s ({s['step_ms'] / epp_ms:.2f}x) {s['layout']}{extra}, {s['peak_gb']:.0f} GB"

    lines = ["| data | model | cap | cluster | EPP: step, layout, plan, peak, recomputed layers | EPP / bound | FlexSP | Seq1F1B (best k) | Megatron |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        e = c["systems"]["epp"]
        if not e["fits"]:
            lines.append(f"| {c['data']} | {c['model']} | {c['cap'] // 1024}K | {c['cluster']} | does not fit | | | | |")
            continue
        epp = f"{e['step_ms'] / 1e3:.1f} s {e['layout']} {e['detail']}, {e['peak_gb']:.0f} GB, {e['recomputed_layers']}"
        lines.append(f"| {c['data']} | {c['model']} | {c['cap'] // 1024}K | {c['cluster']} | {epp} | "
                     f"{e['step_ms'] / e['bound_ms']:.2f} | " + " | ".join(sys_cell(c["systems"][n], e["step_ms"]) for n in ("flexsp", "seq1f1b", "megatron")) + " |")
    return "\n".join(lines)


def write_readme(path: Path, text: str) -> None:
    readme = path.read_text() if path.exists() else ""  # a new file: the block alone
    block = f"{README_BEGIN}\n{text}\n{README_END}"
    if README_BEGIN in readme:
        a, b = readme.index(README_BEGIN), readme.index(README_END) + len(README_END)
        readme = readme[:a] + block + readme[b:]
    else:
        readme = (readme.rstrip("\n") + "\n\n" if readme.strip() else "") + block + "\n"
    path.write_text(readme)


CELL_KEYS = ("data", "model", "cap", "cluster", "gbs", "memory_gb", "overlap", "seed")


def load_cells(path: Path | None) -> dict:
    """Cells already done, from a ``--cells`` file, by :data:`CELL_KEYS`."""
    if path is None or not path.exists():
        return {}
    cells = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {tuple(c[k] for k in CELL_KEYS): c for c in cells}


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small cell (7B, 48K, 64 GitHub-like documents, IB per node)")
    ap.add_argument("--models", type=subset_of(MODEL_PRESETS), default=["llama-7b", "llama-13b", "llama-30b"], help="comma-separated presets")
    ap.add_argument("--caps", type=positive_ints, default=[49152, 98304, 131072], help="comma-separated context caps in tokens (48K: 49152)")
    ap.add_argument("--data", type=subset_of(LENGTH_POOLS), default=["commoncrawl", "github", "code-heavy"], help="comma-separated length distributions")
    ap.add_argument("--clusters", type=subset_of(CLUSTERS), default=["a800-ib-node", "a800-ib-gpu"], help="comma-separated cluster presets")
    ap.add_argument("--gbs", type=int, default=512)
    ap.add_argument("--memory-gb", type=float, default=80.0)
    ap.add_argument("--overlap", type=float, default=COMM_OVERLAP, help="share of ZeRO-3/FSDP/DP-sync collectives hidden behind compute")
    ap.add_argument("--flexsp-time-limit", type=float, default=0.3, help="seconds per FlexSP MILP")
    ap.add_argument("--exhaustive", action="store_true", help="plan every layout (no proxy ranking)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="cells run in parallel processes (the times reported are per cell, CPU)")
    ap.add_argument("--readme", default=None, help="markdown file to write the table into (default docs/measurements/paper-grid.md; none with --quick)")
    ap.add_argument("--cells", type=Path, default=None, help="JSON-lines file: finished cells appended, those already there not re-run")
    ap.add_argument("--report-only", action="store_true", help="with --cells: the table of the cells done so far, nothing run")
    args = ap.parse_args(argv)
    if args.report_only and args.cells is None:
        ap.error("--report-only needs --cells")
    if args.quick:
        args.models, args.caps, args.data, args.clusters, args.gbs = ["llama-7b"], [49152], ["github"], ["a800-ib-node"], 64
    t0 = time.perf_counter()
    pools = {d: length_pool(d, args.seed) for d in args.data}
    grid = [(cl, data, model, cap) for cl in args.clusters for data in pools for model in args.models
            for cap in args.caps]
    done = load_cells(args.cells)

    def key(cl: str, data: str, model: str, cap: int) -> tuple:
        return (data, model, cap, cl, args.gbs, args.memory_gb, args.overlap, args.seed)

    jobs = [(data, batch(pools[data], args.gbs, cap, args.seed), model, cap, cl, args.memory_gb, args.overlap, args.flexsp_time_limit, args.exhaustive)
            for cl, data, model, cap in grid if key(cl, data, model, cap) not in done and not args.report_only]
    jobs.sort(key=work, reverse=True)
    pool = multiprocessing.get_context("fork").Pool(args.jobs, initializer=_worker_signals) if args.jobs > 1 and jobs else None
    stopped, previous = "", signal.signal(signal.SIGTERM, _stop)  # from here a SIGTERM stops the pool, the table is written
    try:
        with solver_output_to_stderr():
            for cell in (pool.imap_unordered(_run_job, jobs) if pool else map(_run_job, jobs)):
                cell.update(gbs=args.gbs, memory_gb=args.memory_gb, overlap=args.overlap, seed=args.seed)
                if args.cells is not None:
                    with args.cells.open("a") as f:
                        f.write(json.dumps(cell, default=float) + "\n")
                done[tuple(cell[k] for k in CELL_KEYS)] = cell
                print(f"# {cell['data']} {cell['model']} {cell['cap'] // 1024}K {cell['cluster']}: " + ", ".join(
                    f"{n} {s['step_ms'] / 1e3:.1f} s" if s["fits"] else f"{n} -" for n, s in cell["systems"].items()), file=sys.stderr, flush=True)
        if pool is not None:
            pool.close()
            pool.join()
    except (Stopped, KeyboardInterrupt) as e:
        stopped = f"stopped by {e or 'SIGINT'} after {time.perf_counter() - t0:.0f} s; "
        print(f"# {stopped}the table of the cells done follows", file=sys.stderr, flush=True)
        for worker in multiprocessing.active_children():
            worker.kill()
    finally:
        signal.signal(signal.SIGTERM, previous)
    cells = [done[key(*g)] for g in grid if key(*g) in done]  # the grid's order
    rows = [ratios(c) for c in cells]
    head = headline(rows, args.clusters)
    wins = [f"- {c['data']} {c['model']} {c['cap'] // 1024}K {c['cluster']}: {why_baseline_wins(c, n)}"
            for c, r in zip(cells, rows) for n in ("flexsp", "seq1f1b", "megatron") if r[n] is not None and r[n] < 1]
    summary = [f"Headline (paper's cells: {'/'.join(PAPER_DATA)}, 48K/96K, 7B/13B/30B), baseline / EPP, geometric mean (max) vs the paper:"]
    for cl, h in head.items():
        summary.append(f"- {cl}: " + "; ".join(
            f"{n} {v['geomean']}x (max {v['max']}x) vs {v['paper']}x{'' if v['within_20pct'] else ' (not within 20 %)'}" for n, v in h.items()))
    far = [f"- {c['data']} {c['model']} {c['cap'] // 1024}K {c['cluster']}: {why_far_from_bound(c)}"
           for c, r in zip(cells, rows) if r["bound"] and 1 / r["bound"] > BOUND_GAP]
    missing = len(grid) - len(cells)
    text = "\n".join([table(cells), "", *summary, "", "Where a baseline is faster:" if wins else "No baseline is faster than EPP in any cell.", *wins, "",
                      f"Where EPP is more than {BOUND_GAP}x its bound:" if far else f"EPP is within {BOUND_GAP}x of its bound in every cell.", *far, "",
                      *([f"{missing} of the {len(grid)} cells not run yet."] if missing else []),
                      f"gbs {args.gbs}, {args.memory_gb:.0f} GB per GPU, collective overlap {args.overlap}, seed {args.seed}; "
                      + ("a report of cells run earlier (--report-only); " if args.report_only
                         else f"this run {time.perf_counter() - t0:.0f} s wall with {args.jobs} process(es); {stopped}")
                      + f"{sum(s.get('search_s', 0.0) for c in cells for s in c['systems'].values()):.0f} s of per-cell search time over the cells shown."])
    print(text)
    readme = args.readme or (None if args.quick else str(REPO / "docs" / "measurements" / "paper-grid.md"))
    if readme:
        write_readme(Path(readme), text)
    print(json.dumps({"cells": rows, "headline": head}, separators=(",", ":")), flush=True)
    if stopped:  # not Pool.terminate: a killed worker may hold the task queue's lock it would wait for
        os._exit(0)


if __name__ == "__main__":
    main()
