"""The longest single document the elastic planner fits per layout, without offload, with checkpoint offload and with
checkpoint + K/V-buffer offload (issue 41; docs/planner.md, "Activation offload"), simulated at paper scale.

For the llama-7b preset on one 8 x H100-80GB node and on 4 such nodes (32 GPUs) of the ``h100-ib-gpu`` preset, every
layout of ``tp x cp x pp`` with one replica (a single document has no data parallelism) among ``--layouts``: the
longest document (a multiple of 65,536 tokens; doubling, then bisection, with the planner's own feasibility check)
that fits ``--epp-offload none``, ``checkpoints`` and ``auto``, with its predicted step time, peak device memory and
host memory per GPU, the copy time no compute hides, and why the next length fails. Simulated: the cost model is the
analytic H100 profile and the preset's host link, whose bandwidth (25 GB/s per GPU and direction) and host memory
(2 TB per node; the budget 75 % of it over 8 GPUs, 192 GB per GPU) are assumptions stated in ``cost/clusters.py``.

    python -m benchmarks.longest_document [--nodes 1,4] [--layouts TP8xPP1,...] [--budget-gb 80] [--offload none,checkpoints]
        [--epp-loss-chunk-tokens N] [--epp-mlp-chunk-tokens N]   # the chunked output head and the tiled MLP, as pretrain_gpt.py's
    python -m benchmarks.longest_document --table LOG   # the markdown table of a run's last (JSON) line

The last line is one JSON object: ``{"rows": [...]}``.
"""

from __future__ import annotations

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

import dataclasses
import json
import time

from megatron_epp.base.units import GIB
from megatron_epp.cost.clusters import get_cluster
from megatron_epp.cost.shape import MODEL_PRESETS
from megatron_epp.planner.cli import solver_output_to_stderr
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.planner.layout import enumerate_layouts, longest_document
from benchmarks.common import Parser

MODES = ("none", "checkpoints", "auto")
DEFAULT_LAYOUTS = {1: ("TP8xPP1xDP1", "TP2xCP4xPP1xDP1", "TP4xPP2xDP1"), 4: ("TP8xPP4xDP1", "TP2xCP4xPP4xDP1", "TP4xPP8xDP1")}


def table(rows: list[dict]) -> str:
    """The markdown table of a run's rows (what docs/measurements shows)."""
    out = ["| GPUs | layout | offload | longest document (tokens) | predicted step (s) | peak device GB/GPU | host GB/GPU | "
           "exposed copy (s, summed over stages) | next length fails because |", "|" + " --- |" * 9]
    for r in rows:
        step = "-" if r["step_ms"] is None else f"{r['step_ms'] / 1e3:.0f}"
        copy = "-" if r["copy_ms"] is None else f"{r['copy_ms'] / 1e3:.0f}"
        out.append(f"| {r['gpus']} | {r['layout']} | {r['offload']} | {r['tokens']:,} | {step} | {r['peak_gb']} | {r['host_gb']} | "
                   f"{copy} | {r['why_not_longer']} |")
    return "\n".join(out)


def main() -> None:
    ap = Parser(prog="longest_document", description=__doc__)
    ap.add_argument("--nodes", default="1,4", help="comma-separated node counts (8 GPUs each)")
    ap.add_argument("--layouts", default=None, help="comma-separated layouts (default: three per node count)")
    ap.add_argument("--budget-gb", type=float, default=80.0, help="device memory budget per GPU, GB")
    ap.add_argument("--model", default="llama-7b", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--cluster", default="h100-ib-gpu")
    ap.add_argument("--epp-loss-chunk-tokens", type=int, default=0, metavar="N",
                    help="the output head chunked in blocks of N tokens (--epp-loss-chunk-tokens; default 0: whole logits)")
    ap.add_argument("--epp-mlp-chunk-tokens", type=int, default=0, metavar="N",
                    help="every layer's MLP in blocks of N tokens a rank (--epp-mlp-chunk-tokens; default 0: the whole chunk's)")
    ap.add_argument("--offload", default=",".join(MODES), help=f"comma-separated offload modes (default {','.join(MODES)})")
    ap.add_argument("--table", metavar="LOG", help="print the markdown table of LOG's last line (a run's JSON) and exit")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(open(args.table).read().strip().splitlines()[-1])["rows"]))
        return
    shape = dataclasses.replace(MODEL_PRESETS[args.model], loss_chunk_tokens=args.epp_loss_chunk_tokens,
                                mlp_chunk_tokens=args.epp_mlp_chunk_tokens)
    rows: list[dict] = []
    modes = [m for m in MODES if m in args.offload.split(",")]
    for nodes in (int(x) for x in args.nodes.split(",")):
        cluster = get_cluster(args.cluster).with_nodes(nodes)
        wanted = args.layouts.split(",") if args.layouts else DEFAULT_LAYOUTS.get(nodes, ())
        layouts = [d for d in enumerate_layouts(shape, cluster, True, 1) if str(d) in wanted]
        print(f"{args.model} on {nodes} x 8 {cluster.accelerator.name}, {args.budget_gb:g} GB per GPU; host: {cluster.host.description}; "
              f"host budget {cluster.host.default_budget_bytes() / GIB:g} GB per GPU", flush=True)
        for layout in layouts:
            for mode in modes:
                t0 = time.perf_counter()
                config = PlannerConfig(args.budget_gb * GIB, 1, profile=args.model, offload=mode)
                with solver_output_to_stderr():
                    found = longest_document(shape, cluster, layout, config)
                row = {"gpus": cluster.world_size, "layout": str(layout), "offload": mode, **found.row(),
                       **({"loss_chunk_tokens": args.epp_loss_chunk_tokens} if args.epp_loss_chunk_tokens else {}),
                       **({"mlp_chunk_tokens": args.epp_mlp_chunk_tokens} if args.epp_mlp_chunk_tokens else {}),
                       "search_s": round(time.perf_counter() - t0, 1)}
                rows.append(row)
                print(f"  {row['layout']:18s} {mode:11s} longest {row['tokens']:>9d} tokens  step {row['step_ms']} ms  "
                      f"peak {row['peak_gb']} GB  host {row['host_gb']} GB  exposed copy {row['copy_ms']} ms  "
                      f"({row['search_s']} s); next: {row['why_not_longer']}", flush=True)
    print(json.dumps({"rows": rows}, separators=(",", ":")))


if __name__ == "__main__":
    main()
