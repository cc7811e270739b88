"""On a CUDA machine: ElasticAttention's varlen paths (flash-attn's, torch's) against its SDPA path, bf16, real layouts.

For each layout every chunk runs forward in plan order and backward in the elastic schedule's order through one
``ElasticAttention`` (``benchmarks/attention_harness.py``), with each backend forced in turn, forward and backward of the
whole layout before the next backend (only the errors and timings are kept), and each layout's tensors released
(``torch.cuda.empty_cache()``) before the next:

  fa4-varlen    one flash-attn-4 (flash_attn.cute) flash_attn_varlen_func call per chunk, the same packing (Hopper/Blackwell);
                probed (and its kernels compiled) before the layouts run, so no timing includes a compile
  flash-varlen  one flash_attn_varlen_func call per chunk (the slice's K/V buffer rows, prefix first)
  torch-varlen  one torch.nn.attention.varlen.varlen_attn call per chunk, the same packing (torch's own flash kernel);
                with GQA on a torch whose varlen_attn has no enable_gqa (2.11), the aten flash ops, K/V not expanded
  sdpa-causal   SDPA per segment (cuDNN attention excluded), is_causal without context, torch's causal_lower_right bias for the slice (no mask built)

``sdpa-masked`` (an explicit bottom-right mask per segment) is a CPU path (attention dropout) and is not run on CUDA: in
bf16 with GQA no fused SDPA kernel takes a mask, and the math kernel held the ``s x (C + s)`` scores of every head (24
GiB for one slice of the split layout: out of memory on an 80 GB H100 on 2026-11-25, before the split and hybrid
results printed). The CPU dry run still runs it.

Default sizes (``--slice-tokens 8192``; heads 32, K/V heads 8, head dim 128, bf16): ``batched`` 10 documents of 256 ..
4096 tokens (12,800 in all), ``split x4`` one 32K document in four 8K slices (the last over 24K of prefix), ``hybrid``
a 24K document in a 16K slice and an 8K tail packed with 4 short documents (4,608 tokens). Run time: each layout has
a third of ``--budget-s`` (default 45 s) from the end of start-up; its fp32 reference, one checked run, one warm-up
and one timed run per backend always run, further timed runs (up to ``--repeats``, default 10) only within its
share. On an H100 the mandatory work is estimated at a few seconds per layout (not yet measured), so the check
should end about 45 s after start-up; the last line says how long it took.

Accuracy: each backend's outputs and q/k/v gradients (prefix-K/V gradients included: they reach
earlier slices' dk/dv) against a float32 reference on the same inputs: per segment, its queries in
blocks, each block's SDPA over the keys it sees under the block's own bottom-right mask (never more
than ``REFERENCE_BLOCK_ELEMENTS`` scores per block), each block checkpointed (its scores recomputed in
backward, not kept): exact attention in float32 whose memory is one block's. The SDPA paths must be
within 8 unit roundoffs of the low precision (bf16: 8 x 2^-8 = 3.1e-2; measured 3e-3 .. 5e-3 on an
H100), each varlen kernel's error within 2x the SDPA error (+1e-3). Speed: median wall ms of the whole
layout's forward+backward (CUDA events), peak allocated memory, and the ratios to the first varlen kernel
that ran (>1: the varlen kernel faster).

Memory: on the split layout with GQA, the bytes autograd saves for backward in one ``ElasticAttention`` (one layer)
while the four slices' forwards are held, torch-varlen forced (``saved_tensors_hooks``, distinct storages counted once:
the K/V buffer, the queries, the outputs, the log-sum-exp), and whether any saved tensor is K/V expanded to the query
heads: ``saved bytes per layer: torch-varlen N (K/V heads not expanded: yes|no)``. Expanded K/V where the kernel's GQA
mode says they are not is a failure.

Without flash-attn (it does not import, or ``--without-flash``), or without torch's ``varlen_attn``, that
kernel is reported as skipped, with the reason, and the others are checked and timed.

    bash scripts/setup_gpu.sh                # flash-attn on the CUDA torch, when it builds
    python -m benchmarks.check_cuda_attention [--num-attention-heads 32 --num-query-groups 8 --kv-channels 128 --repeats 10 --budget-s 45]

``--cpu-dry-run`` runs the same code on CPU float32 at toy sizes with the tests' reference kernels in place of
flash-attn and of torch's varlen_attn (torch 2.11's, GQA through the reference aten flash ops), and sdpa-masked too
(checks the script itself, measures nothing). Exit status 1 if a check fails, 2 without CUDA (outside the dry run).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time


import torch
from torch.utils.checkpoint import checkpoint

from megatron_epp.executor import kernels as attention_kernels
from megatron_epp.executor.context import bottom_right_causal_mask
from megatron_epp.plan import Chunk, Pipeline, Plan, Segment, chunk_kind
from benchmarks.attention_harness import SavedTensors, make_attention, random_tensors, run_plan, worst_errors
from benchmarks.common import Parser

CUDA_BACKENDS = ("fa4-varlen", "flash-varlen", "torch-varlen", "sdpa-causal")  # never sdpa-masked on CUDA (see above)
VARLEN = ("fa4-varlen", "flash-varlen", "torch-varlen")
BACKWARD_FLOPS = 2.5  # the backward's matmul FLOPs per forward FLOP (FlashAttention's count: 5 matmuls against 2)
BUDGET_S = 45.0  # the timing repeats of the three layouts, in all
SDPA_ROUNDOFFS = 8  # SDPA's bound, in unit roundoffs of the low precision
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


REFERENCE = "fp32-reference"  # the blocked float32 reference (run_reference), not a library backend
REFERENCE_BLOCK_ELEMENTS = 2**27  # attention scores per reference block (all heads): 512 MiB in float32


def reference_block_rows(keys: int, heads: int, block_elements: int = REFERENCE_BLOCK_ELEMENTS) -> int:
    """Query rows per reference block over ``keys`` keys: ``rows x keys x heads <= block_elements`` (at least 1)."""
    return max(1, block_elements // (keys * heads))


def _block_attention(q, k, v, context: int, scale: float) -> torch.Tensor:
    """Queries ``q`` (rows ``[context, context + len(q))`` of a segment's keys) over keys ``k``/``v``
    (``[context + len(q), ...]``) under their bottom-right causal mask, built here (so a checkpoint rebuilds it)."""
    return attention_kernels.segment_attention(q, k, v, bottom_right_causal_mask(q.shape[0], context, q.device), 0.0, scale)


def blocked_reference(query, key, value, layout, slice_kv, dropout: float, scale: float,
                      block_elements: int = REFERENCE_BLOCK_ELEMENTS) -> torch.Tensor:
    """The chunk's exact attention (a backend's signature), each segment's queries in blocks of
    :func:`reference_block_rows`: block ``[r0, r1)`` of a segment with ``C`` prefix keys attends keys
    ``[0, C + r1)`` under the bottom-right mask of ``r1 - r0`` queries after ``C + r0`` keys, checkpointed
    so that backward recomputes one block's scores at a time. No attention dropout."""
    if dropout:
        raise ValueError("the reference has no attention dropout")
    outputs = []
    for _, q, k, v in attention_kernels._segments(query, key, value, layout, slice_kv):
        context, heads = k.shape[0] - q.shape[0], q.shape[2]
        rows = reference_block_rows(k.shape[0], heads, block_elements)
        for r0 in range(0, q.shape[0], rows):
            r1 = min(r0 + rows, q.shape[0])
            keys = context + r1
            outputs.append(checkpoint(_block_attention, q[r0:r1], k[:keys], v[:keys], context + r0, scale, use_reentrant=False))
    return torch.cat(outputs)


def run_reference(attention, plan: Plan, tensors, device: str, block_elements: int = REFERENCE_BLOCK_ELEMENTS):
    """``run_plan`` of ``plan`` on :func:`blocked_reference` (float32 tensors: the reference)."""
    backends = attention_kernels.BACKENDS
    attention_kernels.BACKENDS = {**backends, REFERENCE: functools.partial(blocked_reference, block_elements=block_elements)}
    try:
        force(REFERENCE)
        return run_plan(attention, plan, tensors, device)
    finally:
        attention_kernels.BACKENDS = backends


def make_plan(lengths: list[int], chunks: list[list[Segment]]) -> Plan:
    pipe = Pipeline([Chunk(i, chunk_kind(s, lengths), s) for i, s in enumerate(chunks)], [[0] * len(chunks)])
    return Plan(lengths, 1, [1], [pipe], builder="check").validate()


def layouts(scale: int) -> dict[str, Plan]:
    """Realistic chunk shapes; ``scale`` = tokens of one slice (8192 on a GPU)."""
    s = scale
    short = [s // 8, s // 4, s // 16, s // 2, s // 8, s // 32, s // 4, s // 16, s // 8, s // 32]
    batched = make_plan(short, [[Segment(i, 0, n) for i, n in enumerate(short)]])
    long = 4 * s
    split = make_plan([long], [[Segment(0, i * s, (i + 1) * s)] for i in range(4)])
    tail_docs = [s // 8, s // 4, s // 16, s // 8]
    lengths = [3 * s, *tail_docs]
    hybrid = make_plan(lengths, [[Segment(0, 0, 2 * s)], [Segment(0, 2 * s, 3 * s), *[Segment(i + 1, 0, n) for i, n in enumerate(tail_docs)]]])
    return {"batched": batched, "split x4": split, "hybrid": hybrid}


def backends_for(device: str) -> tuple[str, ...]:
    """The backends checked on ``device``: on CUDA :data:`CUDA_BACKENDS`; the CPU dry run adds ``sdpa-masked`` (a CPU path)."""
    return CUDA_BACKENDS if device == "cuda" else (*CUDA_BACKENDS, "sdpa-masked")


def force(backend: str) -> None:
    attention_kernels.select_backend = lambda request, device, dtype, decided=None, dropout=0.0, gqa=False, **kwargs: backend


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """Give the freed blocks back (between layouts: the next one's peak is its own)."""
    if device == "cuda":
        torch.cuda.empty_cache()


def timed(run, device: str, repeats: int, until: float = float("inf")) -> tuple[float, float, int]:
    """Median ms of ``run()`` after one warm-up, peak allocated GB (CUDA), and the timed runs: ``repeats``, fewer where
    ``time.perf_counter()`` passes ``until`` (at least one)."""
    run()
    synchronize(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    while len(times) < repeats and not (times and time.perf_counter() > until):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return statistics.median(times), peak, len(times)


def saved_per_layer(attention, plan: Plan, tensors, device: str, heads: int) -> tuple[int, bool]:
    """Bytes autograd saves in ``attention`` (one layer) while every chunk's forward of ``plan`` is held, torch-varlen
    forced (distinct storages once), and whether none of the saved tensors is K/V expanded to the ``heads`` query heads
    (a saved ``[rows, heads, d]`` tensor that is no chunk's queries or output)."""
    kernel, besides = attention_kernels.BACKENDS["torch-varlen"], set()

    def recorded(query, key, value, layout, slice_kv, *args):
        out = kernel(query, key, value, layout, slice_kv, *args)
        besides.update(t.untyped_storage().data_ptr() for t in (query, out))
        return out

    attention_kernels.BACKENDS["torch-varlen"] = recorded
    try:
        force("torch-varlen")
        with SavedTensors() as saved:
            run_plan(attention, plan, tensors, device)
    finally:
        attention_kernels.BACKENDS["torch-varlen"] = kernel
    return saved.bytes, not saved.heads_wide(heads, besides)


def check_layout(name: str, plan: Plan, attention, args, backends, device: str, dtype: torch.dtype, until: float):
    """One layout: the fp32 reference, then each backend's errors against it and its timing (until ``until``);
    returns ``{backend: errors}``, ``{backend: (ms, peak GB, timed runs)}`` and the low-precision tensors."""
    heads, kv_heads, d = args.num_attention_heads, args.num_query_groups, args.kv_channels
    tensors = random_tensors(plan, heads, kv_heads, d, torch.float32, device, seed=0)
    reference = run_reference(attention, plan, tensors, device, args.reference_block_elements)  # float32
    low = [[type(t)(*(x.to(dtype) for x in (t.q, t.k, t.v, t.grad_out))) for t in row] for row in tensors]
    del tensors
    errors, speed = {}, {}
    for i, backend in enumerate(backends):
        force(backend)
        errors[backend] = worst_errors(run_plan(attention, plan, low, device), reference)  # its results dropped here
        share = (until - time.perf_counter()) / (len(backends) - i)
        speed[backend] = timed(lambda: run_plan(attention, plan, low, device), device, args.repeats, time.perf_counter() + share)
    del reference
    return errors, speed, low


def layout_flops(plan: Plan, heads: int, head_dim: int) -> float:
    """The attention FLOPs of the layout's forward and backward: per segment of ``s`` queries over ``C`` prefix keys and
    its own (causal), ``s * C + s * (s + 1) / 2`` scores per head, 4 FLOPs per score and head dim forward (Q K^T, P V),
    :data:`BACKWARD_FLOPS` times that backward (FlashAttention's convention: the masked half is not counted)."""
    area = 0
    for chunk in plan.chunks():
        for segment in chunk.segments:
            area += segment.length * segment.start + segment.length * (segment.length + 1) // 2
    return 4.0 * area * heads * head_dim * (1 + BACKWARD_FLOPS)


def report_layout(name: str, plan: Plan, backends, skipped: dict[str, str], errors, speed, flops: float = 0.0) -> None:
    chunks = ", ".join(f"{c.kind}({'+'.join(str(s.length) for s in c.segments)}, C={c.segments[0].start if c.kind == 'split' else max(s.start for s in c.segments)})" for c in plan.chunks())
    print(f"\n{name}: {chunks}")
    base = next((b for b in VARLEN if b in speed), None)  # the ratios' denominator
    print(f"  {'backend':<13} {'fwd+bwd ms':>10} {'runs':>4} {'peak GB':>8} {'TFLOP/s':>8} {'/' + (base or 'varlen'):>13}   "
          "worst rel. error vs fp32: out dq dk dv")
    for backend in backends:
        ms, peak, runs = speed[backend]
        e = errors[backend]
        ratio = f"{ms / speed[base][0]:13.2f}" if base else f"{'-':>13}"
        tflops = flops / (ms * 1e9) if ms > 0 else 0.0
        print(f"  {backend:<13} {ms:10.2f} {runs:4d} {peak:8.2f} {tflops:8.1f} {ratio}   " + " ".join(f"{e[k]:.1e}" for k in ("out", "dq", "dk", "dv")))
    for backend, why in skipped.items():
        print(f"  {backend:<13} skipped ({why})")


def failures(errors, backends, sdpa_bound: float) -> list[str]:
    """The SDPA paths beyond ``sdpa_bound``; each varlen kernel beyond twice the worst SDPA path's error (+1e-3)."""
    sdpa = [b for b in backends if b.startswith("sdpa-")]
    found = []
    for backend in sdpa:
        for key in ("out", "dq", "dk", "dv"):
            if errors[backend][key] > sdpa_bound:
                found.append(f"{backend} {key} error {errors[backend][key]:.2e} > {sdpa_bound:.2e} ({SDPA_ROUNDOFFS} unit roundoffs)")
    for backend in (b for b in VARLEN if b in backends):
        for key in ("out", "dq", "dk", "dv"):
            bound = 2 * max(errors[b][key] for b in sdpa) + 1e-3
            if errors[backend][key] > bound:
                found.append(f"{backend} {key} error {errors[backend][key]:.2e} > {bound:.2e}")
    return found


def saved_line(attention, plan: Plan, low, args, device: str, varlen_kernel) -> tuple[str, bool]:
    """The ``saved bytes per layer`` line (torch-varlen with GQA on ``plan``), and whether it is consistent: K/V expanded
    only where the kernel's GQA mode expands them."""
    if varlen_kernel is None or args.num_query_groups == args.num_attention_heads:
        why = "skipped" if varlen_kernel is None else "not measured (no GQA: as many K/V heads as query heads)"
        return f"saved bytes per layer: torch-varlen {why}", True
    saved, not_expanded = saved_per_layer(attention, plan, low, device, args.num_attention_heads)
    mode = varlen_kernel.gqa_mode
    line = (f"saved bytes per layer: torch-varlen {saved} (K/V heads not expanded: {'yes' if not_expanded else 'no'}) "
            f"on split x4, GQA mode {mode}, the 4 slices' forwards held")
    return line, not_expanded or mode == "expanded"


def fa4_kernel(args: argparse.Namespace, device: str, dtype: torch.dtype):
    """flash-attn-4 and its note: probed at this layout's head shape first (its compiles then happen here, not in a
    timing), or ``(None, why not)``."""
    if args.without_fa4:
        return None, "--without-fa4"
    kernel, why = attention_kernels.fa4.load_kernel()
    if kernel is None:
        return None, why
    why = kernel.unsupported(torch.device(device), dtype)
    if why:
        return None, why
    result = attention_kernels.fa4.probe(kernel, torch.device(device), dtype, args.num_attention_heads, args.num_query_groups, args.kv_channels)
    return (None, result.why) if result.why else (kernel, result.note())


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--num-attention-heads", type=int, default=32)
    p.add_argument("--num-query-groups", type=int, default=8)
    p.add_argument("--kv-channels", type=int, default=128)
    p.add_argument("--slice-tokens", type=int, default=8192, help="tokens per slice; layouts scale with it")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per backend and layout at most (after one warm-up)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for the timing repeats of all layouts (default 45)")
    p.add_argument("--reference-block-elements", type=int, default=REFERENCE_BLOCK_ELEMENTS,
                   help="attention scores per block of the fp32 reference, all heads (default 2^27; dry run 2^13)")
    p.add_argument("--cpu-dry-run", action="store_true", help="toy sizes on CPU with the tests' reference kernels")
    p.add_argument("--without-flash", action="store_true", help="check and time the SDPA paths only, as when flash-attn does not import")
    p.add_argument("--without-fa4", action="store_true", help="leave flash-attn-4 out, as when it does not import")
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> tuple[str, torch.dtype] | None:
    """The device and the low precision (None: no CUDA outside the dry run); the dry run's reference kernels and sizes."""
    if args.cpu_dry_run:
        from benchmarks.attention_harness import REFERENCE_KERNEL, reference_fa4_varlen_func, reference_torch_varlen

        attention_kernels.load_flash_kernel = lambda: (REFERENCE_KERNEL, "")
        attention_kernels.load_torch_varlen = lambda: (reference_torch_varlen("aten-flash"), "")  # torch 2.11's, as on the GPUs
        attention_kernels.fa4.load_kernel = lambda: (attention_kernels.fa4.CuteFlashKernel(
            reference_fa4_varlen_func, "reference", devices=("cpu",), dtypes=(torch.float32,), architectures=None), "")
        args.num_attention_heads, args.num_query_groups, args.kv_channels, args.slice_tokens, args.repeats = 4, 2, 8, 64, 2
        args.reference_block_elements = 2**13  # a few rows per block: the blocking runs, as on a GPU
        return "cpu", torch.float32
    if not torch.cuda.is_available():
        print("check_cuda_attention: no CUDA device (use --cpu-dry-run to check the script on CPU)", file=sys.stderr)
        return None
    return "cuda", {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    where = setup(args)
    if where is None:
        return 2
    device, dtype = where
    kernel, why_not = attention_kernels.load_flash_kernel()
    if args.without_flash:
        kernel, why_not = None, "--without-flash"
    varlen_kernel, varlen_why = attention_kernels.load_torch_varlen()
    cute, cute_note = fa4_kernel(args, device, dtype)
    skipped = {name: why for name, k, why in (("fa4-varlen", cute, cute_note), ("flash-varlen", kernel, why_not),
                                              ("torch-varlen", varlen_kernel, varlen_why)) if k is None}
    backends = tuple(b for b in backends_for(device) if b not in skipped)
    flash_note = f"flash-attn {kernel.version}" if kernel is not None else f"flash-varlen: skipped ({why_not})"
    flash_note = (f"flash-attn-4 {cute.version} ({cute_note})" if cute is not None else f"fa4-varlen: skipped ({cute_note})") + "; " + flash_note
    varlen_note = (f"varlen_attn of torch {varlen_kernel.version} (GQA: {varlen_kernel.gqa_mode})" if varlen_kernel is not None
                   else f"torch-varlen: skipped ({varlen_why})")
    print(f"{flash_note}; {varlen_note}; torch {torch.__version__}" + (f", {torch.cuda.get_device_name()}" if device == "cuda" else ", CPU dry run"))
    print(f"heads {args.num_attention_heads}, kv heads {args.num_query_groups}, head dim {args.kv_channels}, slice {args.slice_tokens} tokens, {dtype}; "
          f"fp32 reference in blocks of {args.reference_block_elements} scores; backends {', '.join(backends)}; timing budget {args.budget_s:g} s")
    # the SDPA paths against the fp32 reference, in unit roundoffs of the low precision (the dry run
    # is fp32 throughout: only float32 reordering, bounded by bf16's to keep the check meaningful)
    sdpa_bound = SDPA_ROUNDOFFS * UNIT_ROUNDOFF[torch.bfloat16 if dtype == torch.float32 else dtype]

    attention = make_attention(args.num_attention_heads, args.num_query_groups, args.kv_channels)
    problems, plans = [], layouts(args.slice_tokens)
    budget_start, saved = time.perf_counter(), ""
    for i, (name, plan) in enumerate(plans.items()):
        until = budget_start + args.budget_s * (i + 1) / len(plans)
        errors, speed, low = check_layout(name, plan, attention, args, backends, device, dtype, until)
        report_layout(name, plan, backends, skipped, errors, speed, layout_flops(plan, args.num_attention_heads, args.kv_channels))
        problems += failures(errors, backends, sdpa_bound)
        if name == "split x4":
            saved, consistent = saved_line(attention, plan, low, args, device, None if "torch-varlen" in skipped else varlen_kernel)
            problems += [] if consistent else [f"torch-varlen saved K/V expanded to the query heads in GQA mode {varlen_kernel.gqa_mode}"]
        del low
        release(device)
    print(f"\n{saved}")
    for problem in problems:
        print(f"  FAIL: {problem}")
    passed = [*(b for b in VARLEN if b in backends), "SDPA path" + ("s" if device != "cuda" else "")]
    checked = f"{', '.join(passed[:-1])} and {passed[-1]}" if len(passed) > 1 else passed[0]
    checked += " match fp32" + "".join(f"; {b} skipped ({why})" for b, why in skipped.items())
    print(f"\nPASS: {checked} within {str(dtype).removeprefix('torch.')} rounding" if not problems else "\nFAIL")
    print(f"check_cuda_attention: {time.perf_counter() - started:.1f} s")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
