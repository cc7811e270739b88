"""On a CUDA machine: K/V buffers on the host (``executor.kv_host``) through the CUDA block kernel
(``kernels.BlockFlashKernel``, torch's aten flash ops) against the device-buffer run, bf16 (or fp16).

One layout through one ``ElasticAttention`` (``benchmarks/attention_harness.py`` ``run_plan``: forward in plan order,
backward in the elastic schedule's): a document of ``4 x --slice-tokens`` in four slices, the last packed after a short
document of half a slice, GQA. Three runs on the same inputs: the device-buffer run in float32 (the reference: SDPA per
segment), the device-buffer run in the low precision (the kernel ``auto`` picks, unchanged by kv_host) and the same plan
with the document's K/V buffers on the host (the pool's pinned buffers, the side stream's copies, the block kernel).
The host run's outputs and q/k/v gradients must be as close to the reference as the device-buffer run's: within 2x its
error + 1e-3 (the two are not bit-identical on CUDA: the blocks' log-sum-exp merge rounds differently). Also one timed
forward+backward of each low-precision run (wall ms after a warm-up; not a benchmark of the copies' overlap).

    python -m benchmarks.check_kv_host_cuda [--slice-tokens 4096 --num-attention-heads 32 --num-query-groups 8 --kv-channels 128]

``--cpu-dry-run``: the same code on CPU in float32 at toy sizes, the block kernel's code over the reference aten flash
ops (``REFERENCE_BLOCK_FLASH``), checking the script (measures nothing). Exit status 1 if a check fails, 2 without CUDA
(outside the dry run).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.attention_harness import make_attention, random_tensors, run_plan, worst_errors
from megatron_epp.executor import kernels
from megatron_epp.plan import Chunk, Pipeline, Plan, Segment
from megatron_epp.plan.core import chunk_kind


def make_plan(slice_tokens: int, host: bool) -> Plan:
    """Document 0 in four slices of ``slice_tokens``, the last after document 1 (half a slice); ``host``: document 0's
    K/V buffers on the host."""
    lengths = [4 * slice_tokens, slice_tokens // 2]
    chunks = [[Segment(0, i * slice_tokens, (i + 1) * slice_tokens)] for i in range(3)]
    chunks.append([Segment(1, 0, lengths[1]), Segment(0, 3 * slice_tokens, lengths[0])])
    pipe = Pipeline([Chunk(i, chunk_kind(s, lengths), s) for i, s in enumerate(chunks)], [[0] * 4], kv_host=[0] if host else [])
    return Plan(lengths, 1, [1], [pipe], builder="check").validate()


def timed_run(args, plan: Plan, dtype: torch.dtype, device: str, seed: int = 0):
    """The results of one run of ``plan`` in ``dtype`` (fresh attention) and the wall ms of a second, timed one."""
    heads, groups, dim = args.num_attention_heads, args.num_query_groups, args.kv_channels
    tensors = random_tensors(plan, heads, groups, dim, dtype, device, seed)
    attention = make_attention(heads, groups, dim)
    results = run_plan(attention, plan, tensors, device)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    run_plan(attention, plan, tensors, device)
    if device == "cuda":
        torch.cuda.synchronize()
    return results, (time.perf_counter() - start) * 1e3


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-attention-heads", type=int, default=32)
    p.add_argument("--num-query-groups", type=int, default=8)
    p.add_argument("--kv-channels", type=int, default=128)
    p.add_argument("--slice-tokens", type=int, default=4096)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--cpu-dry-run", action="store_true", help="toy sizes on CPU with the reference aten flash ops")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.cpu_dry_run:
        from benchmarks.attention_harness import REFERENCE_BLOCK_FLASH

        kernels.load_block_flash = lambda: (REFERENCE_BLOCK_FLASH, "")
        args.num_attention_heads, args.num_query_groups, args.kv_channels, args.slice_tokens = 4, 2, 8, 16
        device, low = "cpu", torch.float32
    elif not torch.cuda.is_available():
        print("check_kv_host_cuda: no CUDA device (use --cpu-dry-run to check the script on CPU)", file=sys.stderr)
        return 2
    else:
        device, low = "cuda", {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    kernel = kernels.block_kernel(torch.device(device), low)
    print(f"block kernel: {type(kernel).__name__ if kernel is not None else 'the CPU flash kernel'}; {device} {low}")
    reference, _ = timed_run(args, make_plan(args.slice_tokens, False), torch.float32, device)
    on_device, device_ms = timed_run(args, make_plan(args.slice_tokens, False), low, device)
    on_host, host_ms = timed_run(args, make_plan(args.slice_tokens, True), low, device)
    device_errors, host_errors = worst_errors(on_device, reference), worst_errors(on_host, reference)
    between = worst_errors(on_host, on_device)
    failed = [name for name in host_errors if not host_errors[name] <= 2 * device_errors[name] + 1e-3]
    for name in host_errors:
        print(f"{name}: kv_host {host_errors[name]:.2e}, device buffer {device_errors[name]:.2e} (vs float32); "
              f"kv_host vs device buffer {between[name]:.2e}")
    print(f"forward+backward: device buffer {device_ms:.1f} ms, kv_host {host_ms:.1f} ms")
    print("check_kv_host_cuda: " + (f"FAILED ({', '.join(failed)})" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
