"""The paper grid's Ulysses-SP rows re-planned on layouts ``pretrain_gpt.py`` runs (TP x CP x PP x DP).

Until 2026-11-27 EPP's layout search weighed Ulysses SP with FSDP stages, which the executor cannot run; the
paper grid of 2026-11-24 (``--old``: its cells) chose such a layout for EPP in 35 of its 108 rows. For each of
those rows (the same batch: :func:`paper_grid.length_pool`, :func:`paper_grid.batch`, seed and settings of the
old cell) this plans EPP again with the current search (TP x CP layouts, context parallelism by Ulysses
all-to-all, model states as megatron-core holds them) and reports, row by row:

* ``old EPP``: EPP's step and layout in the old cell (SP + FSDP in the SP rows);
* ``TP ref``: EPP's best TP-only step, the old cell's runner-up when it was a TP layout (the search reported it:
  ``why``), else the new search's best TP layout among those it planned (None if it planned none);
* ``new``: EPP's step on the best runnable layout now, and the layout;
* ``advantage kept``: ``(TP ref / new - 1) / (TP ref / old SP - 1)``: the share of the SP layout's gain over the
  best TP layout that the runnable layouts keep (1: all of it, 0: none, < 0: slower than TP, which the search never
  picks when it planned the TP layout).

With ``--all-rows`` the rows where EPP chose a TP layout follow (``TP ref``: that step; ``kept by new``: what a CP
layout gains over it, 0 where the search keeps TP).

    python -m benchmarks.paper_grid_cp --cells docs/measurements/2026-11-27-cpu-cp/sp_rows_cp.jsonl   # resumable
    python -m benchmarks.paper_grid_cp --cells FILE --report-only --out docs/measurements/2026-11-27-cpu-cp/sp_rows_cp.md

``--cells`` may also be a ``python -m benchmarks.paper_grid --cells`` file (the whole grid, every system): EPP's entry of each
cell is its row (``--report-only --all-rows``: the table of every row against ``--old``).

The last line is one JSON object: ``{"rows": [...], "done": n, "of": m}``.
"""

from __future__ import annotations

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path



from megatron_epp.cost.clusters import get_cluster
from megatron_epp.base.units import GIB
from megatron_epp.cost.shape import MODEL_PRESETS
from megatron_epp.plan import PlanInfeasible
from megatron_epp.planner.builders import ELASTIC
from megatron_epp.planner.cli import solver_output_to_stderr
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.planner.layout import search_layout
from benchmarks.common import REPO, Parser, batch, length_pool, positive_ints

OLD = REPO / "docs" / "measurements" / "2026-11-24-cpu" / "paper_grid_cells.jsonl"
KEYS = ("data", "model", "cap", "cluster")
SETTINGS = ("gbs", "memory_gb", "overlap", "seed")  # a row compares with an old cell of the same (a paper_grid.py cell has them)


def sp_rows(path: Path, all_rows: bool = False) -> list[dict]:
    """The old cells whose EPP layout was Ulysses SP, cheapest search first (as many as time allows get done); with
    ``all_rows`` then the others (EPP on a TP layout), cheapest first."""
    cells = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    is_sp = [c["systems"]["epp"].get("layout", "").startswith("SP") for c in cells]
    first = sorted((c for c, sp in zip(cells, is_sp) if sp), key=lambda c: c["systems"]["epp"]["search_s"])
    rest = sorted((c for c, sp in zip(cells, is_sp) if not sp and c["systems"]["epp"]["fits"]), key=lambda c: c["systems"]["epp"]["search_s"])
    return first + (rest if all_rows else [])


def old_tp_runner_up(cell: dict) -> float | None:
    """The old EPP search's runner-up step when it was a TP layout (``why``: "A x ms beats B y ms")."""
    m = re.search(r"beats (TP\S+) ([0-9.]+) ms", cell["systems"]["epp"]["why"])
    return float(m[2]) if m else None


def run_row(cell: dict) -> dict:
    shape, cluster = MODEL_PRESETS[cell["model"]], get_cluster(cell["cluster"])
    lengths = batch(length_pool(cell["data"], cell["seed"]), cell["gbs"], cell["cap"], cell["seed"])
    config = PlannerConfig(memory_budget_bytes=cell["memory_gb"] * GIB, max_seq_len=cell["cap"], profile=cell["model"])
    t0 = time.perf_counter()
    out = {k: cell[k] for k in KEYS}
    try:
        choice = search_layout(lengths, shape, cluster, ELASTIC, config, overlap=cell["overlap"])
    except PlanInfeasible as e:
        return {**out, "fits": False, "reason": str(e), "search_s": time.perf_counter() - t0}
    tp_planned = [r.step_ms for r in choice.evaluated if r.layout.cp == 1]
    return {**out, "fits": True, "step_ms": choice.best.step_ms, "layout": str(choice.best.layout), "detail": choice.best.detail,
            "peak_gb": choice.best.peak_memory_bytes / GIB, "recomputed_layers": choice.best.recomputed_layers,
            "why": choice.reason, "new_tp_best_planned_ms": min(tp_planned) if tp_planned else None,
            "search_s": time.perf_counter() - t0}


def row_of_cell(cell: dict) -> dict:
    """A row of this script from a ``python -m benchmarks.paper_grid --cells`` line (every system; EPP's entry taken), so that a
    whole re-run grid reports here too; a row of this script's own as it is."""
    if "systems" not in cell:
        return cell
    e, out = cell["systems"]["epp"], {k: cell[k] for k in (*KEYS, *SETTINGS)}
    if not e["fits"]:
        return {**out, "fits": False, "reason": e["reason"], "search_s": e.get("search_s", 0.0)}
    return {**out, **{k: e[k] for k in ("fits", "step_ms", "layout", "detail", "peak_gb", "recomputed_layers", "why", "search_s")},
            "new_tp_best_planned_ms": e.get("tp_best_planned_ms")}


def table(old: list[dict], new: dict[tuple, dict]) -> tuple[list[str], list[dict]]:
    lines = ["| data | model | cap | cluster | old EPP (2026-11-24) | TP ref | new EPP (runnable layouts) | SP gain over TP ref | new gain over TP ref | SP advantage kept |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for c in old:
        key = tuple(c[k] for k in KEYS)
        e = c["systems"]["epp"]
        head = f"| {c['data']} | {c['model']} | {c['cap'] // 1024}K | {c['cluster']} | {e['step_ms'] / 1e3:.2f} s {e['layout']} |"
        if key not in new:
            lines.append(head + " | not run | | | |")
            continue
        n = new[key]
        if not n["fits"]:
            lines.append(head + f" | | does not fit: {n['reason']} | | | |")
            rows.append({**dict(zip(KEYS, key)), "fits": False})
            continue
        # an SP row: the best TP step the old search reported (else the new search planned); a TP row: its own step
        ref = (old_tp_runner_up(c) or n["new_tp_best_planned_ms"]) if e["layout"].startswith("SP") else e["step_ms"]
        gain = ref / e["step_ms"] - 1 if ref and e["layout"].startswith("SP") else None
        kept = ref / n["step_ms"] - 1 if ref else None
        share = kept / gain if gain and gain > 0 else None
        rows.append({**dict(zip(KEYS, key)), "old_sp_ms": e["step_ms"], "tp_ref_ms": ref, "new_ms": n["step_ms"], "new_layout": n["layout"],
                     "sp_gain": gain, "new_gain": kept, "kept": share})
        fmt = (lambda v: f"{v:+.1%}" if v is not None else "n/a")
        lines.append(head + f" {ref / 1e3:.2f} s |" if ref else head + " n/a |")
        lines[-1] += (f" {n['step_ms'] / 1e3:.2f} s {n['layout']} {n['detail']}, {n['peak_gb']:.0f} GB, {n['recomputed_layers']} |"
                      f" {fmt(gain)} | {fmt(kept)} | {f'{share:.0%}' if share is not None else 'n/a'} |")
    return lines, rows


def summary(rows: list[dict]) -> list[str]:
    """The table in a few lines: the SP rows' gains over their TP reference (geometric means of the ratios) and the share
    of the SP gain kept; the TP rows where the new step is above the old (old step / new step - 1 < 0)."""
    def gmean(xs: list[float]) -> str:
        return f"{math.exp(sum(math.log1p(x) for x in xs) / len(xs)) - 1:+.1%}" if xs else "n/a"

    sp = [r for r in rows if r.get("sp_gain") is not None]
    shares = sorted(r["kept"] for r in sp if r["kept"] is not None)
    slower = [r for r in rows if r.get("fits", True) and r.get("sp_gain") is None and r.get("new_gain") is not None and r["new_gain"] < -1e-9]
    return [f"SP rows with a TP reference: {len(sp)}; gain over it: SP + FSDP {gmean([r['sp_gain'] for r in sp])}, "
            f"runnable layouts {gmean([r['new_gain'] for r in sp])} (geometric means); share kept: median "
            + (f"{shares[len(shares) // 2]:.0%}, all of it or more in {sum(x >= 1 - 1e-9 for x in shares)}, none (share <= 0) in {sum(x <= 1e-9 for x in shares)}"
               if shares else "n/a"),
            f"TP rows where the new step is above the old: {len(slower)}" + "".join(
                f"; {r['data']} {r['model'].removeprefix('llama-')} {r['cap'] // 1024}K {r['cluster']} {r['new_layout']} {r['new_gain']:+.1%}"
                for r in slower)]


def row_keys(text: str) -> list[tuple]:
    """``--rows``' argparse ``type``: ``data:model:cap:cluster`` keys, comma-separated (cap in tokens or ``128K``)."""
    rows = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) != len(KEYS):
            raise argparse.ArgumentTypeError(f"{item!r}: expected {':'.join(KEYS)}")
        caps = positive_ints(parts[2])
        rows.append((parts[0], parts[1], caps[0], parts[3]))
    if not rows:
        raise argparse.ArgumentTypeError("no row given")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, default=OLD, help="the earlier grid's cells (JSON lines)")
    ap.add_argument("--cells", type=Path, required=True, help="JSON lines: rows done appended; those there not re-run")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--limit", type=int, default=None, help="run at most this many rows (cheapest first)")
    ap.add_argument("--all-rows", action="store_true", help="after the SP rows, the rows where EPP chose a TP layout")
    ap.add_argument("--out", type=Path, default=None, help="markdown file the table is written to")
    ap.add_argument("--rows", type=row_keys, default=None, help="only these rows: data:model:cap:cluster, comma-separated (e.g. commoncrawl:llama-7b:131072:h100-ib-gpu)")
    args = ap.parse_args(argv)
    old = sp_rows(args.old, args.all_rows)
    if args.rows:
        wanted = set(args.rows)
        old = [c for c in old if tuple(c[k] for k in KEYS) in wanted]
        if len(old) != len(wanted):
            ap.error(f"--rows: {len(wanted) - len(old)} of {len(wanted)} not among {args.old}'s rows" + ("" if args.all_rows else " (SP rows only without --all-rows)"))
    done = {}
    if args.cells.exists():
        for line in args.cells.read_text().splitlines():
            if line.strip():
                r = row_of_cell(json.loads(line))
                done[tuple(r[k] for k in KEYS)] = r
    for c in old:
        r = done.get(tuple(c[k] for k in KEYS), {})
        if any(k in r and r[k] != c[k] for k in SETTINGS):
            ap.error(f"{args.cells}: {' '.join(str(c[k]) for k in KEYS)} was run with "
                     + ", ".join(f"{k} {r[k]}" for k in SETTINGS if k in r and r[k] != c[k]) + f", not as in {args.old}")
    todo = [c for c in old if tuple(c[k] for k in KEYS) not in done][: args.limit] if not args.report_only else []
    with solver_output_to_stderr():
        for c in todo:
            r = run_row(c)
            done[tuple(r[k] for k in KEYS)] = r
            with args.cells.open("a") as f:
                f.write(json.dumps(r) + "\n")
            print(f"# {r['data']} {r['model']} {r['cap'] // 1024}K {r['cluster']}: {r.get('layout', '-')} "
                  f"{r.get('step_ms', float('nan')) / 1e3:.2f} s ({r['search_s']:.0f} s)", file=sys.stderr, flush=True)
    lines, rows = table(sorted(old, key=lambda c: (c["cluster"], c["data"], c["model"], c["cap"])), done)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    text = "\n".join(lines + ["", *summary(rows)])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps({"rows": rows, "done": sum(1 for c in old if tuple(c[k] for k in KEYS) in done), "of": len(old), "commit": commit},
                     separators=(",", ":")))


if __name__ == "__main__":
    main()
