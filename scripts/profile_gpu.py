"""Profile the layer that trains on a GPU (or, for a smoke test, the CPU) and write a planner profile.

Measures, in bf16 on CUDA by default, with the attention kernel training would use (the executor's
own kernels, chosen by ``EPP_ATTENTION_BACKEND`` as in training: flash-attn varlen where it runs,
else SDPA):

  * attention of ``s`` queries over ``C`` prefix + ``s`` own keys, forward and backward, over an
    ``(s, C)`` grid (``--seq-lengths`` x ``--contexts``): fits ``a1`` (s^2), ``a1c`` (s*C), ``ac`` (C)
    and the per-segment constant;
  * one layer of the training spec (``ChunkRecomputeLayer`` + ``ElasticAttention`` on the local spec,
    RoPE) over ``--layer-lengths`` at ``C = 0``: fits the linear term ``a2`` and the per-chunk constant
    after removing the attention's quadratic part; recompute = (forward+backward recomputing as
    training does) - (forward+backward), fitted as a ratio of the forward;
  * the output head (linear + cross entropy) over ``--head-lengths``.

Fits with the CPU profiler's own fit (``scripts/profile_layer.py``: non-negative least squares on
relative error), prints every fit's error, and writes a profile JSON that ``--epp-profile FILE``
reads, with ``"device"`` (the GPU's name, dtype and kernel) and ``"source": "measured"``. Timing:
CUDA events on a GPU, ``time.perf_counter`` on the CPU (``--device cpu``: one thread; for checking
the script, its numbers are not a CPU profile, ``scripts/profile_layer.py`` makes those).

Memory coefficients are not measured here: bf16 takes Megatron's ``34 h`` count (``derive =
"megatron-gpu"``), fp32 the CPU's saved-tensor count (``"saved-tensors-fp32"``); the planner
re-derives both for the trained shape, its dropout probabilities included (CUDA's dropout tensors are modelled,
not measured: ``gpu_activation_memory``; an fp32 profile counts attention dropout as the CPU's SDPA math path
saves it, 12 bytes per head and query-key pair, which CUDA's flash / efficient kernels do not: an over-count).

    python scripts/profile_gpu.py --out runs/h100_h1024.json                   # hidden 1024, 16 heads
    python scripts/profile_gpu.py --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 --out h4096.json
    python scripts/profile_gpu.py --device cpu --hidden-size 32 --num-attention-heads 4 --vocab-size 64 \\
        --seq-lengths 16,32,64 --contexts 0,32 --layer-lengths 16,32,64,128 --head-lengths 16,64 --repeats 2 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

from megatron_epp.cost.features import NUM_FEATURES, F  # noqa: E402
from megatron_epp.cost.profiles import MemoryCoeffs, ModelShape, TimeCoeffs, gpu_activation_memory  # noqa: E402
from megatron_epp.executor import kernels  # noqa: E402
from megatron_epp.executor.context import ChunkLayout  # noqa: E402
from megatron_epp.plan import Chunk, Segment  # noqa: E402
from megatron_epp.tools.layer_bench import LayerStack, init_single_process  # noqa: E402
from profile_layer import derived_memory, fit, measured_profile, rel_errors  # noqa: E402  (the CPU profiler's fit, shared)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected non-negative integers")
    return values


class Timer:
    """Median ms of a forward and of its backward: CUDA events on a GPU, ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def _mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _ms(self, start, end) -> float:
        if self.device.type == "cuda":
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def fwd_bwd(self, run: Callable[..., torch.Tensor], make_inputs: Callable[[], tuple]) -> tuple[float, float]:
        fwd, bwd = [], []
        for i in range(self.warmup + self.repeats):
            inputs = make_inputs()  # outside the timing
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = self._mark()
            out = run(*inputs)
            t1 = self._mark()
            (out if out.dim() == 0 else out.float().sum()).backward()
            t2 = self._mark()
            f, b = self._ms(t0, t1), self._ms(t1, t2)
            if i >= self.warmup:
                fwd.append(f)
                bwd.append(b)
        return statistics.median(fwd), statistics.median(bwd)


def attention_grid(shape: ModelShape, kernel: str, timer: Timer, dtype: torch.dtype, seq_lengths: list[int], contexts: list[int]):
    """``[a1, a1c, a_lin, ac, bs]`` of the attention kernel's forward and backward, and the fit errors."""
    heads, d = shape.num_heads, shape.hidden // shape.num_heads
    run_kernel, scale, device = kernels.BACKENDS[kernel], 1.0 / d**0.5, timer.device
    rows, tf, tb = [], [], []
    for s in seq_lengths:
        for c in contexts:
            chunk = Chunk(0, "split" if c else "batched", [Segment(0, c, c + s)])
            layout = ChunkLayout.build(chunk, [c + s], device)

            def make(s: int = s, c: int = c) -> tuple[torch.Tensor, ...]:
                # a slice's K/V rows as its buffer holds them: the prefix's c rows, then its own s
                return tuple(torch.randn(n, 1, heads, d, device=device, dtype=dtype, requires_grad=True) for n in (s, c + s, c + s))

            def run(q, k_rows, v_rows, layout: ChunkLayout = layout, c: int = c) -> torch.Tensor:
                return run_kernel(q, k_rows[c:], v_rows[c:], layout, (k_rows, v_rows) if c else None, 0.0, scale)

            f, b = timer.fwd_bwd(run, make)
            rows.append([s * s, s * c, s, c, 1.0])
            tf.append(f)
            tb.append(b)
            print(f"  attention s={s:6d} C={c:6d}: fwd {f:8.3f} ms  bwd {b:8.3f} ms", flush=True)
    X = np.array(rows, dtype=float)
    cf, ef = fit(X, np.array(tf))
    cb, eb = fit(X, np.array(tb))
    return cf, cb, {"attention_fwd": ef, "attention_bwd": eb}


def layer_terms(stack: LayerStack, att_f: np.ndarray, att_b: np.ndarray, timer: Timer, lengths: list[int]):
    """The layer's ``a2``/``b1`` (forward, backward) beside the attention's quadratic part, and the
    recompute/forward ratio: the structure of ``scripts/profile_layer.py``'s layer fit."""
    h, device, dtype = stack.shape.hidden, stack.device, stack.dtype
    tf, tb, trc = [], [], []
    for s in lengths:
        stack.set_segments([s], [0])
        x = lambda s=s: (torch.randn(s, 1, h, device=device, dtype=dtype, requires_grad=True),)  # noqa: E731
        f, b = timer.fwd_bwd(stack, x)
        fck, bck = timer.fwd_bwd(lambda t: stack(t, checkpoint=True), x)
        tf.append(f)
        tb.append(b)
        trc.append(max(fck + bck - f - b, 1e-6))
        print(f"  layer s={s:6d}: fwd {f:8.3f} ms  bwd {b:8.3f} ms  recompute {trc[-1]:8.3f} ms", flush=True)
    n = np.array(lengths, dtype=float)
    X = np.stack([n, np.ones_like(n)], 1)
    out = {}
    for name, t, att in (("fwd", np.array(tf), att_f), ("bwd", np.array(tb), att_b)):
        quad = att[0] * n**2 + att[4]  # the attention's s^2 term and per-segment constant
        (a2, b1), _ = fit(X, np.maximum(t - quad, 1e-6))
        out[name] = (TimeCoeffs(att[0], att[1], a2, att[3], att[4], b1), rel_errors(quad + a2 * n + b1, t))
    fc = out["fwd"][0]
    fwd_pred = fc.a1 * n**2 + fc.a2 * n + fc.bs + fc.b1
    (ratio, extra), err = fit(np.stack([fwd_pred, np.ones_like(n)], 1), np.array(trc))
    out["recompute"] = (TimeCoeffs(*(fc.vector() * ratio + np.eye(NUM_FEATURES)[F.CHUNKS] * extra)), {**err, "ratio_to_fwd": float(ratio)})
    return out


def head_terms(stack: LayerStack, timer: Timer, lengths: list[int]):
    h, device, dtype = stack.shape.hidden, stack.device, stack.dtype
    tf, tb = [], []
    for s in lengths:
        f, b = timer.fwd_bwd(stack.head_loss, lambda s=s: (torch.randn(s, 1, h, device=device, dtype=dtype, requires_grad=True),))
        tf.append(f)
        tb.append(b)
        print(f"  head s={s:6d}: fwd {f:8.3f} ms  bwd {b:8.3f} ms", flush=True)
    n = np.array(lengths, dtype=float)
    X = np.stack([n, np.ones_like(n)], 1)
    out = {}
    for name, t in (("head_fwd", tf), ("head_bwd", tb)):
        (a2, b1), err = fit(X, np.array(t))
        out[name] = (TimeCoeffs(0.0, 0.0, a2, 0.0, 0.0, b1), err)
    return out


def memory_block(shape: ModelShape, dtype: torch.dtype) -> MemoryCoeffs:
    """What the planner counts for memory (not measured here): Megatron's bf16 activation count, or
    the CPU's fp32 saved-tensor count; model states as training keeps them (bf16 weights, fp32 main
    gradients, fp32 main params + Adam in the optimizer; no distributed optimizer)."""
    if dtype == torch.float32:
        return derived_memory(shape)
    return MemoryCoeffs(**gpu_activation_memory(shape, 1), weight=2.0, grad=4.0, optim=12.0, distributed_optimizer=False,
                        p2p_token=2.0 * shape.hidden, derive="megatron-gpu")


def device_name(device: torch.device, dtype: torch.dtype, kernel: str) -> str:
    what = f"{str(dtype).removeprefix('torch.')}, {kernel}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({what})"
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} thread, {what})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--name", default=None, help="the profile's model name (default: gpu-h<hidden>)")
    p.add_argument("--num-layers", type=int, default=8, help="layers of the model the profile is for (the planner replaces it)")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden")
    p.add_argument("--vocab-size", type=int, default=257)
    p.add_argument("--seq-lengths", type=ints, default=[512, 1024, 2048, 4096, 8192, 16384], help="attention grid: s")
    p.add_argument("--contexts", type=ints, default=[0, 4096, 16384, 49152], help="attention grid: C")
    p.add_argument("--layer-lengths", type=ints, default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--head-lengths", type=ints, default=[1024, 4096, 8192, 16384])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False (use --device cpu to smoke-test the script)")
    if args.hidden_size % args.num_attention_heads:
        p.error("--hidden-size must be divisible by --num-attention-heads")
    if min(args.seq_lengths + args.layer_lengths + args.head_lengths) < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("lengths and --repeats must be >= 1, --warmup >= 0")
    if len(set(args.layer_lengths)) < 2 or len(set(args.head_lengths)) < 2:
        p.error("--layer-lengths and --head-lengths need two lengths at least (a line is fitted through them)")
    if len(args.seq_lengths) * len(args.contexts) < 5:
        p.error("the attention grid needs 5 (s, C) points at least (5 coefficients are fitted)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda":  # as training sets up a GPU rank (the first contact's layer grid ran this way)
        torch.cuda.set_device(0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    init_single_process()  # the process group (gloo on CPU, one thread) and megatron-core's model-parallel state
    torch.manual_seed(0)
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)  # the RNG tracker the recompute checkpoint reads
    shape = ModelShape(args.name or f"gpu-h{args.hidden_size}", args.num_layers, args.hidden_size, args.num_attention_heads,
                       args.ffn_hidden_size or 4 * args.hidden_size, args.vocab_size, swiglu=False)  # the local spec: GELU MLP
    kernel = kernels.select_backend(kernels.requested_backend(), device, dtype)  # as training chooses (EPP_ATTENTION_BACKEND)
    name = device_name(device, dtype, kernel)
    print(f"profiling {shape.name} (hidden {shape.hidden}, {shape.num_heads} heads, ffn {shape.ffn_hidden}, vocab {shape.vocab}) on {name}", flush=True)
    timer = Timer(device, args.warmup, args.repeats)
    t0 = time.perf_counter()
    att_f, att_b, errors = attention_grid(shape, kernel, timer, dtype, args.seq_lengths, args.contexts)
    stack = LayerStack(shape, num_layers=1, device=device, dtype=dtype)
    layer = layer_terms(stack, att_f, att_b, timer, args.layer_lengths)
    head = head_terms(stack, timer, args.head_lengths)
    errors.update({k: v[1] for k, v in {**layer, **head}.items()})
    profile = measured_profile(shape, name, layer, head, memory_block(shape, dtype),
                               {"errors": errors, "torch": torch.__version__, "kernel": kernel, "dtype": args.dtype,
                                "grid": {"seq_lengths": args.seq_lengths, "contexts": args.contexts, "layer_lengths": args.layer_lengths,
                                         "head_lengths": args.head_lengths, "warmup": args.warmup, "repeats": args.repeats},
                                "note": "measured by scripts/profile_gpu.py (medians; CUDA events on GPU, perf_counter on CPU); "
                                        "memory not measured"})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.out)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.1f} s): device {name!r}, source measured")
    for key, e in errors.items():
        print(f"  {key:14s} rms rel err {e['rms_rel_err'] * 100:6.2f} %   max {e['max_rel_err'] * 100:6.2f} %   ({e['points']} points)")
    print(json.dumps({"profile": args.out, "device": name, "worst_rms_rel_err": max(e["rms_rel_err"] for e in errors.values())}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
