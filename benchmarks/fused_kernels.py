"""Side by side: each fused pointwise kernel candidate (megatron_epp.executor.fused: torch.compile, liger-kernel,
quack-kernels) against torch's unfused op, per op, at one layer's shapes; forward + backward time (median) and the
largest error of its output and gradients against an fp32 reference. The last line printed is one JSON object.

On a GPU (the lead's scripts/gpu_check.sh): ``python -m benchmarks.fused_kernels`` at the quick model's shapes
(hidden 2048, 16 heads, 4 K/V heads, ffn 5632, 32K tokens, bf16). On the CPU, ``--device cpu --tokens 64
--hidden 64 --heads 4 --kv-heads 2 --ffn 96 --vocab 128`` smoke-tests it (the tests run that; CPU times mean nothing
for a GPU). ``linear_cross_entropy`` times the libraries' fused output-layer-plus-loss (the fp32 logits of a long
chunk never whole on the device) against torch's linear then cross entropy; it is not wired into training yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch

from megatron_epp.executor import fused

OPS = (*fused.OPS, "linear_cross_entropy")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fused_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    p.add_argument("--candidates", default=",".join(fused.BACKENDS), help="comma-separated, of torch, compile, liger, quack")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    args.candidates = [c.strip() for c in args.candidates.split(",") if c.strip()]
    bad = [op for op in args.ops if op not in OPS] + [c for c in args.candidates if c not in fused.BACKENDS]
    if bad:
        p.error(f"unknown op or candidate: {', '.join(bad)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False (use --device cpu to smoke-test)")
    if min(args.tokens, args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab, args.repeats) < 1 or args.hidden % args.heads:
        p.error("sizes must be positive and --hidden a multiple of --heads")
    args.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    return args


def make_inputs(op: str, args: argparse.Namespace, device: torch.device) -> tuple:
    """The op's inputs at the layer's shapes, fp32 (cast per candidate): hidden states, fc1 output, query/key with
    per-token angles (positions 0..T-1 as packed documents would give), logits and labels."""
    g = torch.Generator(device="cpu").manual_seed(0)
    t, h, d = args.tokens, args.hidden, args.hidden // args.heads

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    if op == "norm":
        return randn(t, 1, h), 1 + randn(h, scale=0.1), 1e-5, 0.0
    if op == "swiglu":
        return (randn(t, 1, 2 * args.ffn),)
    if op == "rope":
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        positions = torch.arange(t, dtype=torch.float32) % 4096  # documents of 4096 tokens packed
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)[:, None, None, :].to(device)
        return randn(t, 1, args.heads, d), randn(t, 1, args.kv_heads, d), torch.cos(angles), torch.sin(angles)
    labels = torch.randint(0, args.vocab, (t, 1), generator=g).to(device)
    if op == "cross_entropy":
        return randn(t, 1, args.vocab, scale=2.0), labels
    return randn(t, h), randn(args.vocab, h, scale=h ** -0.5), labels.view(-1)


def _linear_cross_entropy(backend: str) -> Callable:
    """The output layer and the summed loss: torch's ``linear`` then cross entropy, liger's
    ``LigerFusedLinearCrossEntropyFunction``, quack's ``chunked_linear_cross_entropy`` (both sum the loss here)."""
    if backend == "torch":
        return lambda x, w, labels: fused.reference_cross_entropy(torch.nn.functional.linear(x, w), labels).sum()
    if backend == "liger":
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        return lambda x, w, labels: LigerFusedLinearCrossEntropyFunction.apply(x, w, labels, None, None, -100, 0.0, 0.0, "sum")[0]
    if backend == "quack":
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        return lambda x, w, labels: chunked_linear_cross_entropy(x, w, labels, reduction="sum")
    raise fused.FusedKernelError("linear_cross_entropy: no compiled candidate (the logits are what a compile would keep)")


def candidate(op: str, backend: str) -> Callable:
    """The function timed for ``op`` on ``backend`` (raises where it cannot run here)."""
    if op == "linear_cross_entropy":
        return _linear_cross_entropy(backend)
    libraries = fused.probe_libraries()
    if backend in fused.LIBRARIES and libraries[backend][0] is None:
        raise fused.FusedKernelError(libraries[backend][1])
    return fused.kernel(op, backend, libraries)


def run_once(function: Callable, inputs: tuple) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forward, backward of the sum of squares (a gradient every output feeds), outputs and input gradients."""
    outputs = function(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    sum(o.float().square().sum() for o in outputs).backward()
    grads = [t.grad for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return [o.detach() for o in outputs], grads


def _cast(inputs: tuple, dtype: torch.dtype, grad: bool) -> tuple:
    return tuple(t.detach().to(dtype, copy=True).requires_grad_(grad) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                 for t in inputs)  # fresh leaves: gradients never accumulate over calls


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(op: str, backend: str, args: argparse.Namespace, device: torch.device, reference: tuple) -> dict:
    """One candidate: median ms of forward + backward over ``--repeats`` (after two warm-up calls, which compile),
    and the largest absolute error of outputs and gradients against the fp32 reference."""
    try:
        function = candidate(op, backend)
    except Exception as error:  # noqa: BLE001  (absent, refused, or failing its import: reported, never fatal)
        return {"op": op, "candidate": backend, "skipped": str(error)[:200]}
    base = make_inputs(op, args, device)
    try:
        for _ in range(2):
            run_once(function, _cast(base, args.dtype, True))
        times = []
        for _ in range(args.repeats):
            inputs = _cast(base, args.dtype, True)
            _sync(device)
            start = time.perf_counter()
            outputs, grads = run_once(function, inputs)
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
    except Exception as error:  # noqa: BLE001  (a kernel that fails at these shapes: reported)
        return {"op": op, "candidate": backend, "failed": f"{type(error).__name__}: {str(error)[:200]}"}
    error = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outputs + grads, reference[0] + reference[1], strict=True))
    return {"op": op, "candidate": backend, "ms": round(statistics.median(times), 4), "max_abs_error": error}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    results = []
    for op in args.ops:
        reference_function = _linear_cross_entropy("torch") if op == "linear_cross_entropy" else fused.REFERENCE[op]
        reference = run_once(reference_function, _cast(make_inputs(op, args, device), torch.float32, True))
        for backend in args.candidates:
            row = measure(op, backend, args, device, reference)
            results.append(row)
            print(json.dumps(row), flush=True)
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dtype": str(args.dtype).removeprefix("torch."), "torch": torch.__version__,
               "shape": {k: getattr(args, k) for k in ("tokens", "hidden", "heads", "kv_heads", "ffn", "vocab")},
               "results": results}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
