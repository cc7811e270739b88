#!/usr/bin/env python3
"""Host time per layer and chunk of the elastic layer, megatron-core's per-layer RoPE against the chunk's shared
RoPE tables (``executor.rotary``), paired.

A stack of ``--layers`` layers of the training spec (``measure.layer_bench.LayerStack``) at a tiny hidden size,
where Python and op dispatch dominate (on a GPU they are the per-chunk constant the cost profile fits), runs one
packed chunk forward and backward, each pass inside ``ChunkContext.running`` as the schedule runs it. Variant
``megatron``: the layers get the chunk's raw frequencies (``rotary_pos_emb``), megatron-core's
``apply_rotary_pos_emb`` runs per layer for q and k; ``shared``: they get the :class:`ChunkRope`, one table per
pass. The two alternate within each repeat (order swapped every other repeat); per variant the median ms per
layer of forward and of backward, and of the paired differences the median and the interquartile range (the
noise). Times are this process's CPU time (one thread: the wall time on an idle core, not inflated by
other processes on the machine). The last line is JSON.

    python3 -m benchmarks.layer_host_time --layers 8 --hidden 32 --tokens 64 --repeats 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


import torch

from megatron_epp.cost.shape import ModelShape
from megatron_epp.measure.layer_bench import LayerStack
from benchmarks.common import Parser

VARIANTS = ("megatron", "shared")


def one_pass(stack: LayerStack, x: torch.Tensor, grad: torch.Tensor, variant: str) -> tuple[float, float]:
    """Forward and backward seconds of the stack over its current chunk."""
    view = stack.context.view()
    t0 = time.process_time()
    with stack.context.running(view):
        rope = stack.rotary(x.shape[0])
        rotary_pos_emb = rope.freqs() if variant == "megatron" else rope
        h = x
        for layer in stack.layers:
            h = layer(h, attention_mask=None, rotary_pos_emb=rotary_pos_emb)[0]
    t1 = time.process_time()
    with stack.context.running(view):
        h.backward(grad)
    t2 = time.process_time()
    return t1 - t0, t2 - t1


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main(argv: list[str] | None = None) -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the chunk (two packed documents)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    for name in ("layers", "hidden", "heads", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.tokens < 2 or args.hidden % args.heads or (args.hidden // args.heads) % 2:
        parser.error("--tokens must be >= 2 and --hidden a multiple of --heads with an even head dimension")
    dtype = getattr(torch, args.dtype)
    shape = ModelShape("host", args.layers, args.hidden, args.heads, 4 * args.hidden, 64, swiglu=False)
    stack = LayerStack(shape, args.layers, dtype=dtype)
    first = args.tokens // 2
    stack.set_segments([first, args.tokens - first], [0, 0])
    x = torch.randn(args.tokens, 1, args.hidden, dtype=dtype, requires_grad=True)
    grad = torch.randn(args.tokens, 1, args.hidden, dtype=dtype)
    times = {v: {"fwd": [], "bwd": []} for v in VARIANTS}
    for repeat in range(args.repeats + 2):  # two warm-up repeats
        for variant in VARIANTS if repeat % 2 else VARIANTS[::-1]:
            fwd, bwd = one_pass(stack, x, grad, variant)
            if repeat >= 2:
                times[variant]["fwd"].append(fwd * 1e3 / args.layers)
                times[variant]["bwd"].append(bwd * 1e3 / args.layers)
    result = {"device": "cpu", "threads": torch.get_num_threads(), "dtype": args.dtype, "layers": args.layers,
              "hidden": args.hidden, "tokens": args.tokens, "repeats": args.repeats, "ms_per_layer": {}, "saved_ms_per_layer": {}}
    for variant in VARIANTS:
        result["ms_per_layer"][variant] = {p: round(statistics.median(times[variant][p]), 4) for p in ("fwd", "bwd")}
    for p in ("fwd", "bwd"):
        diffs = [a - b for a, b in zip(times["megatron"][p], times["shared"][p])]
        low, mid, high = quartiles(diffs)
        result["saved_ms_per_layer"][p] = {"median": round(mid, 4), "iqr": [round(low, 4), round(high, 4)]}
        m, s = result["ms_per_layer"]["megatron"][p], result["ms_per_layer"]["shared"][p]
        print(f"{p}: megatron RoPE {m:.4f} ms/layer, shared tables {s:.4f} ms/layer; paired difference median "
              f"{mid:.4f} ms (IQR {low:.4f} .. {high:.4f})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
