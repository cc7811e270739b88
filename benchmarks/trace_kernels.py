#!/usr/bin/env python3
"""Where a profiled step's GPU time goes, by kernel class, from a PyTorch profiler trace (``--profile
--use-pytorch-profiler``: ``tensorboard_trace_handler``'s ``*.pt.trace.json``, gzipped or not).

    python -m benchmarks.trace_kernels TRACE_OR_DIR     # the newest trace under DIR; one JSON line

Every device kernel (trace category ``kernel``) is put in one class by its name (:data:`CLASSES`, the first pattern
that matches, else ``other``): attention (FlashAttention 2/4, cuDNN/efficient attention), GEMMs (cuBLAS, CUTLASS,
nvjet), normalisation, Triton kernels (liger-kernel's and torch.compile's fused pointwise ops), elementwise and
reductions of torch, copies and NCCL. The report: each class's milliseconds and share of the device's kernel time,
the kernel count, the traced wall time (the ``ProfilerStep#`` spans) and the device's busy share of it (kernel time
over wall time, overlapping kernels counted each). Memory copies (``gpu_memcpy``/``gpu_memset``) are reported apart.
A trace without device kernels (a CPU run) gives zero kernels: nothing is inferred from host events.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

# (class, pattern on the kernel's name), the first match wins
CLASSES = (
    ("attention", r"flash|fmha|attn|attention|FlashAttn"),
    ("nccl", r"nccl"),
    ("gemm", r"gemm|sm90_xmma|sm80_xmma|cutlass|nvjet|cublas|wgmma|xmma_"),
    ("norm", r"norm"),
    ("triton", r"^triton_|_kernel_\d*$|liger"),
    ("reduction", r"reduce|softmax|cross_entropy|nll_loss|log_softmax|sum_kernel"),
    ("elementwise", r"elementwise|vectorized|unrolled|CatArrayBatchedCopy|copy_kernel|fill|index|scatter|gather"),
)


def kernel_class(name: str) -> str:
    for label, pattern in CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def newest_trace(path: Path) -> Path:
    if path.is_file():
        return path
    traces = sorted((p for p in path.rglob("*.pt.trace.json*")), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no *.pt.trace.json under {path}")
    return traces[-1]


def read_events(trace: Path) -> list[dict]:
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarise(events: list[dict]) -> dict:
    """The report of one trace's events (see the module's doc)."""
    by_class: dict[str, float] = {}
    count, copies_us = 0, 0.0
    for event in events:
        category, duration = event.get("cat", ""), float(event.get("dur", 0.0))
        if category == "kernel":
            label = kernel_class(event.get("name", ""))
            by_class[label] = by_class.get(label, 0.0) + duration
            count += 1
        elif category in ("gpu_memcpy", "gpu_memset"):
            copies_us += duration
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("ph") == "X"]
    wall_us = sum(float(e.get("dur", 0.0)) for e in steps)
    total_us = sum(by_class.values())
    ordered = sorted(by_class.items(), key=lambda item: -item[1])
    return {
        "kernels": count, "kernel_ms": total_us / 1e3, "wall_ms": wall_us / 1e3 or None, "steps": len(steps),
        "busy_share": total_us / wall_us if wall_us else None, "copies_ms": copies_us / 1e3,
        "classes": {label: {"ms": us / 1e3, "share": us / total_us} for label, us in ordered} if total_us else {},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace_kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a *.pt.trace.json(.gz), or a folder holding some (the newest is read)")
    parser.add_argument("--iteration", type=int, default=None, help="the training iteration the trace recorded (carried into the JSON)")
    args = parser.parse_args(argv)
    try:
        trace = newest_trace(args.path)
        report = {"trace": str(trace), "iteration": args.iteration, **summarise(read_events(trace))}
    except (OSError, ValueError, KeyError) as error:
        parser.exit(2, f"trace_kernels: error: {error}\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
