#!/usr/bin/env python3
"""The per-chunk cost on the H200, derived from the committed logs (issue 40, part 3); reads only committed files.

The bench's wiki@16K cell (``docs/measurements/2026-11-27-h200/bench-37db641/bench.log``) is rebuilt here: its batches
(``benchmarks.common.wiki_lengths``, seed 1234, 16 documents, 6 steps: the log's tokens per step are checked), the
budget it printed, and the H200 start-up profile committed in ``quick-b36fb31`` (measured at h2048; placed on the bench's
h4096 8-layer shape by FLOP scaling, ``cost.analytic.shape_time``: the bench's own h4096 profile was not committed).
Megatron packing's and Seq1F1B k=8's plans are rebuilt exactly (their chunks and recomputed layers per step equal the
log's; checked); EPP's are not (they depend on the uncommitted profile), so EPP enters only through the log's counts.

Per measured step (the log's ``steps_ms``, warm-up dropped) the plan's predicted step is split into its token work
(every coefficient but the per-chunk ``b1`` and per-segment ``bs``) and its constants; least squares (numpy) of the
measured ms on ``[work, chunks, 1]`` gives the speed factor, the per-chunk constant and a per-step constant (the
optimizer, the step's host work), and the same fit without the intercept. Then the EPP steps' paired excess over
Megatron's against their extra chunks and recomputed layers (the log's counts). Every figure is derived from the logs.

    python -m benchmarks.chunk_cost      # a table, then one JSON line
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from benchmarks.common import REPO, wiki_lengths
from megatron_epp.base.units import GIB
from megatron_epp.cost.features import chunk_features
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.profile import Profile
from megatron_epp.data.mock_documents import MockDocuments
from megatron_epp.data.sequence_sampler import SequenceSampler
from megatron_epp.planner.builders import MEGATRON, SEQ1F1B
from megatron_epp.planner.config import PlannerConfig

H200 = REPO / "docs" / "measurements" / "2026-11-27-h200"
PROFILE = H200 / "quick-b36fb31" / "nvidia-h200_bfloat16_torch-varlen_h2048_s32768_8e57df5065.json"
LOG = H200 / "bench-37db641" / "bench.log"
BUDGET_GB, CAP, GBS, STEPS, SEED = 32.5595703125, 16384, 16, 6, 1234  # the log's wiki@16K cell
LOG_TOKENS = [22541, 46491, 30301, 36938, 51089, 64816]
# the log's plans of the measured steps (after the warm-up): chunks and recomputed layers
LOG_PLANS = {"megatron": ([3, 2, 3, 4, 4], [18, 12, 18, 24, 24]), "seq1f1b": ([42, 25, 34, 58, 65], [252, 150, 204, 348, 390]),
             "epp": ([6, 4, 5, 7, 4], [24, 13, 15, 19, 24])}


def bench_cost_models() -> tuple[CostModel, CostModel]:
    """The H200 profile on the bench's shape, and the same with every ``b1`` and ``bs`` zero (token work only)."""
    p = Profile.load(PROFILE)
    p = replace(p, model=replace(p.model, num_layers=8, hidden=4096, num_heads=32, ffn_hidden=11008, num_kv_heads=8))
    names = ("fwd", "bwd", "recompute", "head_fwd", "head_bwd")
    work = replace(p, **{k: replace(getattr(p, k), b1=0.0, bs=0.0) for k in names})
    return CostModel(p, 1), CostModel(work, 1)


def wiki_batches() -> list[list[int]]:
    lengths, _ = wiki_lengths(CAP, GBS, STEPS, SEED)
    order = SequenceSampler(MockDocuments(np.full(GBS * STEPS, 2), 257), GBS, CAP, seed=SEED).stream(0, GBS * STEPS)
    batches = [lengths[order[b * GBS:(b + 1) * GBS]].tolist() for b in range(STEPS)]
    if [sum(b) for b in batches] != LOG_TOKENS:
        raise SystemExit(f"chunk_cost: the rebuilt batches' tokens {[sum(b) for b in batches]} are not the log's {LOG_TOKENS}")
    return batches


def plan_ms(plan, model: CostModel) -> float:
    """Forward + backward + recompute ms of a one-stage plan on ``model`` (no bubbles at pp 1)."""
    total = 0.0
    for pipe in plan.pipelines:
        c = model.costs(chunk_features(pipe.chunks))
        total += float((c.fwd + c.bwd).sum()) + float((c.rc_layer * np.asarray(pipe.recompute).sum(axis=0)).sum())
    return total


def measured() -> dict:
    line = [x for x in LOG.read_text().splitlines() if x.startswith('{"device"')][-1]
    return next(c for c in json.loads(line)["cells"] if c["data"] == "wiki")


def rows_of(cm: CostModel, work: CostModel, cell: dict) -> list[dict]:
    rows, config = [], PlannerConfig(BUDGET_GB * GIB, CAP)
    for run, builder in (("megatron", MEGATRON), ("seq1f1b", SEQ1F1B.at(8))):
        for i, batch in enumerate(wiki_batches()[1:]):
            step = builder.plan(batch, cm, config)
            chunks, recomputed = sum(len(p.chunks) for p in step.plan.pipelines), step.plan.recomputed_layers()
            if (chunks, recomputed) != (LOG_PLANS[run][0][i], LOG_PLANS[run][1][i]):
                raise SystemExit(f"chunk_cost: {run} step {i + 2} rebuilt with {chunks} chunks, {recomputed} recomputed layers; "
                                 f"the log ran {LOG_PLANS[run][0][i]}, {LOG_PLANS[run][1][i]}")
            rows.append({"run": run, "step": i + 2, "chunks": chunks, "recomputed": recomputed,
                         "predicted_ms": round(step.report.predicted_step_ms, 1), "work_ms": round(plan_ms(step.plan, work), 1),
                         "measured_ms": round(cell[run]["steps_ms"][i], 1)})
    return rows


def fits(rows: list[dict]) -> dict:
    y = np.array([r["measured_ms"] for r in rows])
    out = {}
    for name, cols in (("work+chunks+step", ("work_ms", "chunks", None)), ("work+chunks", ("work_ms", "chunks"))):
        X = np.array([[r[c] if c else 1.0 for c in cols] for r in rows])
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        rel = X @ coef / y - 1
        out[name] = {"speed_factor": round(float(coef[0]), 3), "per_chunk_ms": round(float(coef[1]), 2),
                     "per_step_ms": round(float(coef[2]), 1) if len(coef) > 2 else 0.0, "rms_rel_err": round(float(np.sqrt(np.mean(rel**2))), 4)}
    return out


def epp_excess(cell: dict) -> dict:
    """EPP's paired excess over Megatron packing per measured step against its extra chunks and recomputed layers (the
    log's counts): least squares ``excess = per_chunk x d_chunks + per_layer x d_recomputed`` (no intercept)."""
    d_ms = np.array(cell["epp"]["steps_ms"]) - np.array(cell["megatron"]["steps_ms"])
    d_chunks = np.subtract(LOG_PLANS["epp"][0], LOG_PLANS["megatron"][0])
    d_layers = np.subtract(LOG_PLANS["epp"][1], LOG_PLANS["megatron"][1])
    coef, *_ = np.linalg.lstsq(np.stack([d_chunks, d_layers], 1).astype(float), d_ms, rcond=None)
    return {"excess_ms": [round(float(x), 1) for x in d_ms], "extra_chunks": d_chunks.tolist(), "extra_recomputed": d_layers.tolist(),
            "per_chunk_ms": round(float(coef[0]), 2), "per_recomputed_layer_ms": round(float(coef[1]), 2)}


def charged(cm: CostModel) -> dict:
    """What the profile charges per chunk on the bench's shape: every layer's ``b1`` forward + backward and the
    head's; per recomputed layer of a chunk its recompute ``b1``."""
    p = cm.profile
    per_chunk = float(cm.layers.sum()) * (p.fwd.b1 + p.bwd.b1) + p.head_fwd.b1 + p.head_bwd.b1 + p.overhead.fwd_ms + p.overhead.bwd_ms
    return {"per_chunk_ms": round(per_chunk, 2), "per_recomputed_layer_ms": round(p.recompute.b1, 2)}


def main() -> None:
    cm, work = bench_cost_models()
    cell = measured()
    rows = rows_of(cm, work, cell)
    print("| run | step | chunks | recomputed layers | predicted ms | token work ms | measured ms | measured / predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['step']} | {r['chunks']} | {r['recomputed']} | {r['predicted_ms']} | {r['work_ms']} | "
              f"{r['measured_ms']} | {r['measured_ms'] / r['predicted_ms']:.3f} |")
    out = {"cell": "wiki@16K", "budget_gb": BUDGET_GB, "profile": str(PROFILE.relative_to(REPO)), "rows": rows,
           "fits": fits(rows), "epp_vs_megatron": epp_excess(cell), "profile_charges": charged(cm)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
