"""ElasticAttention's kernel backends on CPU: the varlen kernels' contracts, and backend selection.

CI has no GPU, no flash-attn, and torch's ``varlen_attn`` runs on CUDA only, so both varlen paths
(``flash-varlen``, ``torch-varlen``) are checked against reference implementations of the kernels'
documented semantics (``benchmarks/attention_harness.py``: plain torch, ``einsum`` + ``softmax``, not SDPA).
Forcing ``EPP_ATTENTION_BACKEND=flash`` (``varlen``) on CPU float32 with a reference as the kernel, through
the real path's index building (``cu_seqlens``, max lengths, the slice's prefix rows packed before its
own), outputs and gradients (q, k, v, and the prefix-K/V path through the sequences' K/V buffers) must
equal the SDPA path on random batched/split/hybrid plans, with and without GQA, in each GQA mode of
``torch-varlen``: ``varlen_attn`` with ``enable_gqa`` (torch 2.13); torch 2.11's without it, through the
reference aten flash ops (``aten::_flash_attention_forward``/``_backward``, K/V heads not expanded: checked
with ``saved_tensors_hooks``); and K/V heads expanded (the last resort); misplacing the prefix, leaving it out
of ``cu_seqlens_k`` or moving a ``cu_seq_k`` boundary by one must break the match. The kernel decision
(:func:`kernels.decide`) is pinned for every combination of its inputs (the GQA mode in its reason), the aten
ops' schema check refuses other schemas, and the SDPA paths are shown to exclude cuDNN attention. What this does
not check: the real CUDA kernels, and the aten flash ops' signatures on torch 2.11
(``benchmarks/check_cuda_attention.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import sys
import types

import numpy as np
import pytest
import torch

from megatron_epp.executor import attention as elastic_attention, kernels as attention_kernels
from megatron_epp.executor.kernels import AttentionBackendError, FlashKernel, TorchVarlenKernel
from megatron_epp.executor import context as context_module
from megatron_epp.executor.context import ChunkContext, ChunkView, VarlenSeqlens, varlen_seqlens
from megatron_epp.plan import Chunk, Segment
from benchmarks.attention_harness import (
    REFERENCE_FLASH_OPS, REFERENCE_KERNEL, VARLEN_GQA_MODES, SavedTensors, make_attention, random_tensors,
    reference_flash_attention_backward, reference_flash_attention_forward, reference_flash_attn_varlen_func, reference_torch_varlen,
    reference_varlen_attn, run_plan, worst_errors,
)
from tests.workers.random_plans import random_lengths, random_plan

TOL = 1e-5  # float32, same maths in a different order: measured ~1e-7
NO_VARLEN = "torch's varlen_attn not in this test"


@pytest.fixture(autouse=True)
def fresh_decisions(monkeypatch):
    """No request in the environment; torch's varlen_attn absent unless a test gives one (``use_varlen``): this
    torch's real one runs on CUDA only and would ask a CPU machine for a CUDA device's compute capability."""
    monkeypatch.delenv(attention_kernels.ENV, raising=False)
    attention_kernels.reset_flash_probe()
    use_varlen(monkeypatch, None)
    monkeypatch.setattr(attention_kernels.fa4, "load_kernel", lambda: (None, ""))  # flash-attn-4: tests/unit/test_fa4_attention.py
    yield
    attention_kernels.reset_flash_probe()


def use_kernel(monkeypatch, kernel: FlashKernel | None, why_not: str = "flash-attn does not import (test)") -> None:
    monkeypatch.setattr(attention_kernels, "load_flash_kernel", lambda: (kernel, "" if kernel else why_not))


def use_varlen(monkeypatch, kernel: TorchVarlenKernel | None, why_not: str = NO_VARLEN) -> None:
    monkeypatch.setattr(attention_kernels, "load_torch_varlen", lambda: (kernel, "" if kernel else why_not))


def plans(cases: int):
    for case in range(cases):
        lengths = random_lengths(np.random.default_rng([5, case]))
        yield case, random_plan(np.random.default_rng([5, case, 1]), lengths, 1, 1)


HEADS = [(4, 4), (4, 2), (6, 1)]  # MHA, GQA, MQA


def run_backend(monkeypatch, request: str, plan, heads: int, kv_heads: int, seed: int, context: ChunkContext | None = None):
    monkeypatch.setenv(attention_kernels.ENV, request)
    attention = make_attention(heads, kv_heads, 8, context=context)
    tensors = random_tensors(plan, heads, kv_heads, 8, torch.float32, "cpu", seed)
    return run_plan(attention, plan, tensors, "cpu")


def flash_vs_sdpa(monkeypatch, plan, heads: int, kv_heads: int, seed: int) -> dict[str, float]:
    use_kernel(monkeypatch, REFERENCE_KERNEL)
    sdpa = run_backend(monkeypatch, "sdpa", plan, heads, kv_heads, seed)
    flash = run_backend(monkeypatch, "flash", plan, heads, kv_heads, seed)
    return worst_errors(flash, sdpa)


def test_random_plans_cover_every_chunk_kind_with_context():
    kinds, contexts = set(), 0
    for _, plan in plans(8):
        kinds |= {k for k, n in plan.chunk_counts().items() if n}
        contexts += sum(ChunkView.build(c, plan.seq_lengths, torch.device("cpu")).context > 0 for p in plan.pipelines for c in p.chunks)
    assert kinds == {"batched", "split", "hybrid"} and contexts >= 8


@pytest.mark.parametrize("heads, kv_heads", HEADS, ids=["mha", "gqa", "mqa"])
def test_flash_varlen_contract_matches_sdpa(monkeypatch, capsys, heads, kv_heads):
    for case, plan in plans(8):
        errors = flash_vs_sdpa(monkeypatch, plan, heads, kv_heads, seed=case)
        assert max(errors.values()) < TOL, f"case {case}: {errors}"
    log = capsys.readouterr().out
    assert "> elastic attention: flash-varlen (EPP_ATTENTION_BACKEND=flash, cpu float32; flash-attn reference)" in log
    assert "> elastic attention: sdpa-merged (EPP_ATTENTION_BACKEND=sdpa, cpu float32" in log


GQA_MODES = list(VARLEN_GQA_MODES)  # enable_gqa (torch 2.13), aten-flash (2.11), expanded (the last resort)


def recording_kernel(gqa: str, varlen_calls: list, aten_calls: list) -> TorchVarlenKernel:
    """The reference torch-varlen kernel in GQA mode ``gqa``, its ``varlen_attn`` calls recorded in ``varlen_calls``
    and its aten flash forward/backward calls (``aten-flash``) in ``aten_calls`` as ``("forward"|"backward", args, kwargs)``."""
    kernel = reference_torch_varlen(gqa, func=recording(VARLEN_GQA_MODES[gqa][0], varlen_calls))
    if kernel.flash_ops is None:
        return kernel
    ops = kernel.flash_ops
    forward, backward = (recording(op, aten_calls) for op in (ops.forward, ops.backward))
    return dataclasses.replace(kernel, flash_ops=attention_kernels.FlashOps(forward, backward))


@pytest.mark.parametrize("gqa", GQA_MODES)
@pytest.mark.parametrize("heads, kv_heads", HEADS, ids=["mha", "gqa", "mqa"])
def test_torch_varlen_contract_matches_sdpa(monkeypatch, capsys, heads, kv_heads, gqa):
    """``EPP_ATTENTION_BACKEND=varlen`` with the reference kernel in each GQA mode equals the SDPA path on random
    batched/split/hybrid plans, outputs and gradients (prefix K/V included); ONE kernel call per chunk with the
    layer's scale, causal bottom-right: ``varlen_attn(..., window_size=(-1, 0))`` (a tuple), with ``enable_gqa=True``
    and the K/V heads as they are (torch 2.13), or with the K/V heads expanded (the last resort); or, in ``aten-flash``
    mode (2.11), every chunk whose query heads share K/V heads through the aten flash forward (``is_causal``,
    window ``(-1, 0)``, K/V at ``kv_heads`` width) and its backward once per chunk."""
    varlen_calls, aten_calls = [], []
    kernel = recording_kernel(gqa, varlen_calls, aten_calls)
    assert kernel.gqa_mode == gqa  # read from the signature and the ops given
    chunks = 0
    for case, plan in plans(8):
        use_varlen(monkeypatch, kernel)
        sdpa = run_backend(monkeypatch, "sdpa", plan, heads, kv_heads, seed=case)
        varlen_calls.clear()
        aten_calls.clear()
        varlen = run_backend(monkeypatch, "varlen", plan, heads, kv_heads, seed=case)
        errors = worst_errors(varlen, sdpa)
        assert max(errors.values()) < TOL, f"case {case}: {errors}"
        n = sum(len(p.chunks) for p in plan.pipelines)
        through_aten = gqa == "aten-flash" and kv_heads != heads
        assert len(varlen_calls) == (0 if through_aten else n)  # one call per chunk
        names = [name for name, _, _ in aten_calls]
        assert (names.count("forward"), names.count("backward"), len(names)) == ((n, n, 2 * n) if through_aten else (0, 0, 0))
        chunks += n
        for (q, k, v, cu_q, cu_k, max_q, max_k), kwargs in varlen_calls:
            assert kwargs["window_size"] == (-1, 0) and type(kwargs["window_size"]) is tuple
            assert kwargs["scale"] == pytest.approx(8 ** -0.5) and q.shape[1] == heads
            assert k.shape[1] == v.shape[1] == (heads if gqa == "expanded" else kv_heads)
            assert kwargs.get("enable_gqa", False) == (gqa == "enable_gqa" and kv_heads != heads)
        for name, args, kwargs in aten_calls:
            q, k, v = args[(name == "backward"):][:3]
            assert q.shape[1] == heads and k.shape[1] == v.shape[1] == kv_heads  # not expanded
            assert kwargs == {"scale": pytest.approx(8 ** -0.5), "window_size_left": -1, "window_size_right": 0}
            assert len(args) == (10 if name == "forward" else 14) and args[-3 if name == "forward" else -4:][:2] == (0.0, True)
    assert chunks >= 20
    log = capsys.readouterr().out
    note = f", {kernel.gqa_note()}" if kv_heads != heads else ""
    assert f"> elastic attention: torch-varlen (EPP_ATTENTION_BACKEND=varlen, cpu float32; torch reference varlen_attn, one call per chunk{note})\n" in log


def recording(func, calls: list, name: str | None = None):
    """``func`` with each call's arguments appended to ``calls`` (as ``(args, kwargs)``, or ``(name, args, kwargs)`` where
    a ``name`` is given, else the aten reference's ``forward``/``backward``); its signature stays ``func``'s
    (``functools.wraps``), which is what the varlen probe reads."""
    name = name or {reference_flash_attention_forward: "forward", reference_flash_attention_backward: "backward"}.get(func)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        calls.append((args, kwargs) if name is None else (name, args, kwargs))
        return func(*args, **kwargs)
    return wrapper


def test_torch_varlen_gqa_modes_agree(monkeypatch):
    """GQA through the aten flash ops, and with the K/V heads expanded, give what ``enable_gqa`` gives, outputs and
    gradients; the grouping matters: K/V heads tiled (0 1 0 1, not 0 0 1 1) break the match."""
    results = {}
    for gqa in GQA_MODES:
        use_varlen(monkeypatch, reference_torch_varlen(gqa))
        results[gqa] = [run_backend(monkeypatch, "varlen", plan, 6, 2, seed=case) for case, plan in plans(4)]
    for gqa in ("aten-flash", "expanded"):
        for case, (other, native) in enumerate(zip(results[gqa], results["enable_gqa"])):
            assert max(worst_errors(other, native).values()) < 1e-6, f"{gqa}, case {case}"
    monkeypatch.setattr(attention_kernels, "expand_kv_heads", lambda kv, heads: kv.repeat(1, heads // kv.shape[1], 1))
    tiled = [run_backend(monkeypatch, "varlen", plan, 6, 2, seed=case) for case, plan in plans(4)]
    assert min(max(worst_errors(t, n).values()) for t, n in zip(tiled, results["enable_gqa"])) > 1e-2


@pytest.mark.parametrize("planted", [False, True], ids=["as-is", "expansion-planted"])
@pytest.mark.parametrize("heads, kv_heads", HEADS[1:], ids=["gqa", "mqa"])
def test_aten_flash_saves_kv_at_kv_heads_width(monkeypatch, heads, kv_heads, planted):
    """torch-varlen in ``aten-flash`` mode (torch 2.11) saves for backward what ``varlen_attn``'s own autograd saves:
    q, the K/V at ``kv_heads`` width (a split slice's prefix rows as views of its buffer), the output, the log-sum-exp;
    no saved tensor is K/V expanded to the query heads (``saved_tensors_hooks`` over each chunk's kernel call, on
    random batched/split/hybrid plans). ``expansion-planted``: the K/V heads expanded before the same Function
    (outputs and gradients still right) must be seen."""
    use_varlen(monkeypatch, reference_torch_varlen("aten-flash"))
    if planted:
        real_apply = attention_kernels.AtenFlashVarlen.apply
        expand = attention_kernels.expand_kv_heads
        monkeypatch.setattr(attention_kernels.AtenFlashVarlen, "apply",
                            lambda q, k, v, *rest: real_apply(q, expand(k, q.shape[1]), expand(v, q.shape[1]), *rest))
    real_kernel, calls = attention_kernels.torch_varlen, []

    def recorded(query, key, value, view, slice_kv, *args):
        with SavedTensors() as saved:
            out = real_kernel(query, key, value, view, slice_kv, *args)
        calls.append((saved, {query.untyped_storage().data_ptr(), out.untyped_storage().data_ptr()}, view.context))
        return out

    monkeypatch.setitem(attention_kernels.BACKENDS, "torch-varlen", recorded)
    for case, plan in plans(4):
        sdpa = run_backend(monkeypatch, "sdpa", plan, heads, kv_heads, seed=case)
        varlen = run_backend(monkeypatch, "varlen", plan, heads, kv_heads, seed=case)
        assert max(worst_errors(varlen, sdpa).values()) < TOL, f"case {case}"
    assert len(calls) >= 10 and sum(context > 0 for *_, context in calls) >= 4  # slices with prefix K/V among them
    expanded = [saved.heads_wide(heads, besides) for saved, besides, _ in calls]
    kv_width = [sum(len(shape) == 3 and shape[1] == kv_heads for shape, _ in saved.saved) for saved, _, _ in calls]
    if planted:
        assert all(len(shapes) == 2 for shapes in expanded), expanded  # K and V, heads wide
        return
    assert not any(expanded), expanded
    assert kv_width == [2] * len(calls)  # K and V, saved at kv_heads width


def test_torch_varlen_refuses_attention_dropout():
    q = torch.randn(4, 1, 2, 8)
    view = ChunkView.build(Chunk(0, "batched", [Segment(0, 0, 4)]), [4], torch.device("cpu"))
    with pytest.raises(ValueError, match="torch-varlen has no attention dropout"):
        attention_kernels.torch_varlen(q, q, q, view, None, 0.1, 1.0)


@pytest.mark.parametrize("path", ["sdpa-causal", "sdpa-masked", "unwrapped"])
def test_sdpa_paths_exclude_cudnn(monkeypatch, path):
    """The per-segment SDPA paths that run on CUDA call SDPA only inside ``sdpa_kernel([FLASH_ATTENTION,
    EFFICIENT_ATTENTION, MATH])``: cuDNN attention is off at every segment's call (torch's flag, read there).
    ``unwrapped`` (the context manager replaced by a no-op) shows the check sees the difference."""
    real_kernel, real_segment = attention_kernels.sdpa_kernel, attention_kernels.segment_attention
    entered, cudnn_at_call = [], []

    @contextlib.contextmanager
    def recording_kernel(backends, *args, **kwargs):
        entered.append(list(backends))
        with real_kernel(backends, *args, **kwargs):
            yield

    def recording_segment(*args, **kwargs):  # each segment's SDPA call (F.scaled_dot_product_attention itself is left
        cudnn_at_call.append(torch.backends.cuda.cudnn_sdp_enabled())  # alone: torch's CausalBias dispatch checks it by identity)
        return real_segment(*args, **kwargs)

    unwrapped = path == "unwrapped"
    monkeypatch.setattr(attention_kernels, "sdpa_kernel", (lambda backends: contextlib.nullcontext()) if unwrapped else recording_kernel)
    monkeypatch.setattr(attention_kernels, "segment_attention", recording_segment)
    force_backend(monkeypatch, "sdpa-causal" if unwrapped else path)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default
    for case, plan in plans(2):
        run_backend(monkeypatch, "auto", plan, 4, 2, seed=case)
    assert cudnn_at_call and torch.backends.cuda.cudnn_sdp_enabled()  # restored after each chunk
    if unwrapped:
        assert all(cudnn_at_call)
        return
    assert not any(cudnn_at_call)
    from torch.nn.attention import SDPBackend
    assert entered and all(b == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH] for b in entered)


def force_backend(monkeypatch, name: str) -> None:
    monkeypatch.setattr(attention_kernels, "select_backend", lambda request, device, dtype, decided=None, dropout=0.0, gqa=False, **kwargs: name)


@pytest.mark.parametrize("path", ["sdpa-causal", "sdpa-merged"])
def test_sdpa_paths_match_masked(monkeypatch, path):
    """The CUDA SDPA path's maths (is_causal where there is no context) and the CPU path (is_causal, and
    the slice's prefix and own keys merged by their log-sum-exp) against the explicit mask, run on CPU:
    outputs and gradients of q, k, v and the prefix through the K/V buffers, MHA/GQA/MQA."""
    for heads, kv_heads in HEADS:
        sdpa = {}
        for name in ("sdpa-masked", path):
            force_backend(monkeypatch, name)
            sdpa[name] = [run_backend(monkeypatch, "auto", plan, heads, kv_heads, seed=case) for case, plan in plans(6)]
        for case, (other, masked) in enumerate(zip(sdpa[path], sdpa["sdpa-masked"])):
            assert max(worst_errors(other, masked).values()) < TOL, f"{heads}/{kv_heads} heads, case {case}"


def test_sdpa_causal_builds_no_mask(monkeypatch):
    """The CUDA SDPA path gives the slice with context torch's ``causal_lower_right`` bias, never a mask of
    its own (SDPA's flash / efficient kernels then build none; on CPU torch builds it inside SDPA); a torch
    whose ``CausalBias`` takes no ``enable_gqa`` (SDPA hands it on) gets the explicit mask, with the same results."""
    force_backend(monkeypatch, "sdpa-masked")
    reference = {kv: [run_backend(monkeypatch, "auto", plan, 4, kv, seed=case) for case, plan in plans(3)] for kv in (4, 2)}
    built = []
    real_mask = attention_kernels.bottom_right_causal_mask
    for module in (attention_kernels, context_module):  # the kernels' own, and the view's (ChunkView.masks)
        monkeypatch.setattr(module, "bottom_right_causal_mask", lambda *a, **k: built.append(a) or real_mask(*a, **k))
    force_backend(monkeypatch, "sdpa-causal")
    assert attention_kernels._causal_bias_takes_gqa()  # this torch's
    for takes_gqa in (True, False):
        monkeypatch.setattr(attention_kernels, "_causal_bias_takes_gqa", lambda: takes_gqa)
        for kv in (4, 2):
            built.clear()
            for case, plan in plans(3):
                out = run_backend(monkeypatch, "auto", plan, 4, kv, seed=case)
                assert max(worst_errors(out, reference[kv][case]).values()) < TOL, f"kv heads {kv}, case {case}"
            assert bool(built) == (not takes_gqa), (kv, takes_gqa, len(built))


def test_sdpa_merged_bf16_within_rounding_of_fp32(monkeypatch):
    """bf16 through the merged path against the fp32 masked path on the same inputs: within bf16's rounding
    (measured 2e-3 .. 1e-2 worst relative error), as the masked path in bf16 is."""
    errors = {}
    for case, plan in plans(4):
        force_backend(monkeypatch, "sdpa-masked")
        ref = run_plan(make_attention(4, 2, 8), plan, random_tensors(plan, 4, 2, 8, torch.float32, "cpu", case), "cpu")
        for name in ("sdpa-masked", "sdpa-merged"):
            force_backend(monkeypatch, name)
            low = run_plan(make_attention(4, 2, 8), plan, random_tensors(plan, 4, 2, 8, torch.bfloat16, "cpu", case), "cpu")
            errors[name, case] = max(worst_errors(low, ref).values())
    assert all(np.isfinite(e) and e < 3e-2 for e in errors.values()), errors
    merged = max(e for (n, _), e in errors.items() if n == "sdpa-merged")
    masked = max(e for (n, _), e in errors.items() if n == "sdpa-masked")
    assert merged < 2 * masked + 1e-3, errors


@pytest.mark.parametrize("fault", ["prefix-weight", "lse-backward", "causal-own"])
def test_sdpa_merged_fault_breaks_the_match(monkeypatch, fault):
    """Each part of the merge matters: the prefix's weight in the forward, the merged log-sum-exp in the
    backward (a part's own would give wrong gradients with right outputs), the own block's causality."""
    real, real_bwd = attention_kernels._cpu_flash, attention_kernels._cpu_flash_backward
    if fault == "prefix-weight":
        calls = []
        def flash(q, k, v, p, causal, scale=None):
            out, lse = real(q, k, v, p, causal, scale=scale)
            calls.append(causal)
            return out, (lse - 0.5 if not causal else lse)
        monkeypatch.setattr(attention_kernels, "_cpu_flash", flash)
    elif fault == "lse-backward":
        def backward(do, q, k, v, out, lse, p, causal, scale=None):
            own_out, own_lse = real(q, k, v, p, causal, scale=scale)
            return real_bwd(do, q, k, v, own_out, own_lse, p, causal, scale=scale)
        monkeypatch.setattr(attention_kernels, "_cpu_flash_backward", backward)
    else:
        monkeypatch.setattr(attention_kernels, "_cpu_flash", lambda q, k, v, p, causal, scale=None: real(q, k, v, p, False, scale=scale))
    worst = 0.0
    for case, plan in plans(6):
        force_backend(monkeypatch, "sdpa-masked")
        masked = run_backend(monkeypatch, "auto", plan, 4, 2, seed=case)
        force_backend(monkeypatch, "sdpa-merged")
        merged = run_backend(monkeypatch, "auto", plan, 4, 2, seed=case)
        worst = max(worst, max(worst_errors(merged, masked).values()))
    assert not worst < TOL, worst


def lenient_reference(q, k, v, cu_q, cu_k, *args, **kwargs):
    """The flash reference without its check that ``cu_seqlens_k`` covers every key (the real kernel has none)."""
    end = int(cu_k[-1])
    return reference_flash_attn_varlen_func(q, k[:end], v[:end], cu_q, cu_k, *args, **kwargs)


LENIENT = {  # each varlen backend's reference kernel without that check
    "flash": FlashKernel(lenient_reference, "reference", devices=("cpu",), dtypes=(torch.float32,), min_capability=None),
    "varlen": reference_torch_varlen(func=functools.partial(reference_varlen_attn, strict=False)),
    "varlen-aten-flash": dataclasses.replace(reference_torch_varlen("aten-flash"), flash_ops=attention_kernels.FlashOps(
        functools.partial(reference_flash_attention_forward, strict=False), functools.partial(reference_flash_attention_backward, strict=False))),
}
VARLEN_PATHS = {"flash": "flash", "varlen": "varlen", "varlen-aten-flash": "varlen"}  # a path -> its EPP_ATTENTION_BACKEND


class SeqlensWithoutPrefix(ChunkContext):
    """Gives the kernels ``cu_seqlens_k`` that leave the slice's prefix keys out."""

    def running(self, view: ChunkView):
        view = dataclasses.replace(view)
        view.varlen = varlen_seqlens(view.bounds, view.split_index, 0, view.device)
        return super().running(view)


class SliceKeysEndOneEarly(ChunkContext):
    """Gives the kernels the real path's ``cu_seqlens_k`` with one boundary off by one: the slice's keys end a
    row early (the next segment's start there; a slice that is last leaves the last key out)."""

    def running(self, view: ChunkView):
        if view.split_index is not None:
            real = view.varlen
            cu_k = real.cu_seqlens_k.clone()
            cu_k[view.split_index + 1] -= 1
            view = dataclasses.replace(view)
            view.varlen = VarlenSeqlens(real.cu_seqlens_q, cu_k, real.max_seqlen_q, int((cu_k[1:] - cu_k[:-1]).max()))
        return super().running(view)


def use_backend_kernel(monkeypatch, request: str, kernel) -> None:
    (use_kernel if request == "flash" else use_varlen)(monkeypatch, kernel)


def broken(monkeypatch, fault: str, request: str) -> tuple[FlashKernel | TorchVarlenKernel, ChunkContext | None]:
    """Break a varlen path's packing on purpose (``request``: ``flash``, ``varlen``, or ``varlen-aten-flash``: torch-varlen
    with GQA through the aten flash ops); returns the kernel and the chunk context to run it with."""
    kernel = REFERENCE_KERNEL if request == "flash" else reference_torch_varlen("aten-flash" if request == "varlen-aten-flash" else "enable_gqa")
    original_pack = attention_kernels.pack_kv

    def prefix_rows(rows, view):
        start, end = view.bounds[view.split_index]
        return rows.shape[0] - (end - start)

    if fault == "prefix_after_slice_tokens":
        def pack_kv(own, rows, view):
            c = prefix_rows(rows, view)
            return original_pack(own, torch.cat([rows[c:], rows[:c]]), view)
        monkeypatch.setattr(attention_kernels, "pack_kv", pack_kv)
        return kernel, None
    if fault == "prefix_detached":  # the later slices' gradients never reach the earlier slices' K/V
        def pack_kv(own, rows, view):
            c = prefix_rows(rows, view)
            return original_pack(own, torch.cat([rows[:c].detach(), rows[c:]]), view)
        monkeypatch.setattr(attention_kernels, "pack_kv", pack_kv)
        return kernel, None
    if fault == "cu_seqlens_k_without_prefix":  # caught by the reference's argument contract
        return kernel, SeqlensWithoutPrefix()
    if fault == "cu_seqlens_k_without_prefix_lenient":  # caught by the values
        return LENIENT[request], SeqlensWithoutPrefix()
    if fault == "cu_seq_k_off_by_one":  # caught by the values (the lenient reference: no argument check to trip)
        return LENIENT[request], SliceKeysEndOneEarly()
    raise ValueError(fault)


PREFIX_FAULTS = ["prefix_after_slice_tokens", "prefix_detached", "cu_seqlens_k_without_prefix", "cu_seqlens_k_without_prefix_lenient",
                 "cu_seq_k_off_by_one"]


@pytest.mark.parametrize("request_", list(VARLEN_PATHS))
@pytest.mark.parametrize("fault", PREFIX_FAULTS)
def test_contract_test_catches_prefix_faults(monkeypatch, fault, request_):
    """Each fault, planted in the real path of ``flash-varlen`` / ``torch-varlen`` (``enable_gqa``, and GQA through the
    aten flash ops), is caught on every plan that has a slice with context (by the reference's argument contract, or
    by outputs/gradients off by > 1e-2)."""
    kernel, context = broken(monkeypatch, fault, request_)
    caught = checked = 0
    for case, plan in plans(4):
        if not any(ChunkView.build(c, plan.seq_lengths, torch.device("cpu")).context for p in plan.pipelines for c in p.chunks):
            continue
        checked += 1
        sdpa = run_backend(monkeypatch, "sdpa", plan, 4, 2, seed=case)
        use_backend_kernel(monkeypatch, request_, kernel)
        try:
            varlen = run_backend(monkeypatch, VARLEN_PATHS[request_], plan, 4, 2, seed=case, context=context)
        except AssertionError:  # the reference kernel's argument contract
            assert "lenient" not in fault and "off_by_one" not in fault
            caught += 1
            continue
        caught += max(worst_errors(varlen, sdpa).values()) > 1e-2
    assert checked >= 2 and caught == checked


def test_off_by_one_plant_changes_only_the_slice_boundary(monkeypatch):
    """The planted ``cu_seq_k`` is the real one with the slice's end moved by one row, nothing else (so what the
    fault test catches is that boundary): checked on a hybrid chunk."""
    view = ChunkView.build(Chunk(1, "hybrid", [Segment(1, 0, 5), Segment(0, 12, 20), Segment(2, 0, 7)]), [20, 5, 7], torch.device("cpu"))
    seen = []
    with SliceKeysEndOneEarly().running(view) as planted:
        seen.append(planted.varlen)
    assert view.varlen.cu_seqlens_k.tolist() == [0, 5, 25, 32] and seen[0].cu_seqlens_k.tolist() == [0, 5, 24, 32]
    assert seen[0].cu_seqlens_q is view.varlen.cu_seqlens_q and (seen[0].max_seqlen_q, seen[0].max_seqlen_k) == (8, 19)


def test_kernel_decided_once_per_model_on_its_context(monkeypatch, capsys):
    """The attention kernel is the model's decision (kept on its ChunkContext, no module state): its layers print
    it once; another model decides (and prints) for itself."""
    use_kernel(monkeypatch, None)
    chunk = Chunk(0, "batched", [Segment(0, 0, 4)])
    for context in (ChunkContext(), ChunkContext()):
        layers = [make_attention(4, 4, 8, layer_number=i, context=context) for i in (1, 2, 3)]
        with context.running(ChunkView.build(chunk, [4], torch.device("cpu"))):
            for _ in range(2):
                for layer in layers:
                    layer(*(torch.randn(4, 1, 4, 8) for _ in range(3)))
        assert context.attention_backends == {("auto", "cpu", torch.float32, False, False): "sdpa-merged"}
    assert capsys.readouterr().out.count("> elastic attention: sdpa-merged") == 2


def test_flash_call_arguments_and_seqlens_built_once_per_chunk(monkeypatch):
    """One kernel call per layer per chunk; int32 cu_seqlens shared by every layer; causal, scale, dropout passed."""
    calls = []

    def recording(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append((q.shape, k.shape, cu_q, cu_k, max_q, max_k, kwargs))
        return reference_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **{**kwargs, "dropout_p": 0.0})

    use_kernel(monkeypatch, FlashKernel(recording, "recording", devices=("cpu",), dtypes=(torch.float32,), min_capability=None))
    monkeypatch.setattr(elastic_attention.tensor_parallel, "get_cuda_rng_tracker", lambda: types.SimpleNamespace(fork=contextlib.nullcontext))
    monkeypatch.setenv(attention_kernels.ENV, "flash")
    context = ChunkContext()
    layers = [make_attention(4, 2, 8, dropout=0.25, layer_number=i, context=context) for i in (1, 2)]
    lengths = [20, 5, 7]
    first = Chunk(0, "split", [Segment(0, 0, 12)])
    hybrid = Chunk(1, "hybrid", [Segment(1, 0, 5), Segment(0, 12, 20), Segment(2, 0, 7)])
    for chunk in (first, hybrid):
        with context.running(ChunkView.build(chunk, lengths, torch.device("cpu"))):
            for layer in layers:
                n = chunk.num_tokens
                layer.train()
                layer(torch.randn(n, 1, 4, 8), torch.randn(n, 1, 2, 8), torch.randn(n, 1, 2, 8), attention_mask=None)
    assert len(calls) == 4
    (_, k0, cq0, ck0, *_), _, (q1, k1, cq1, ck1, max_q, max_k, kwargs), (_, _, cq1b, ck1b, *_) = calls
    assert k0[0] == 12 and q1[0] == 20 and k1[0] == 32  # the hybrid's keys: 5 + (12 prefix + 8) + 7
    assert cq1.tolist() == [0, 5, 13, 20] and ck1.tolist() == [0, 5, 25, 32] and (max_q, max_k) == (8, 20)
    assert cq1.dtype == ck1.dtype == torch.int32 and ck0.tolist() == [0, 12]
    assert cq1b is cq1 and ck1b is ck1  # built once per chunk, not per layer
    assert kwargs["causal"] is True and kwargs["softmax_scale"] == pytest.approx(8 ** -0.5) and kwargs["dropout_p"] == 0.25


def test_sdpa_reads_the_slices_kv_in_place(monkeypatch):
    """SDPA path: a slice attends to rows of its sequence's K/V buffer, not to a copy (the only
    ``torch.cat`` joins the segments' outputs); the buffer holds ``2 * kv_hidden * 4`` bytes (fp32 K
    and V) per token of the whole sequence and layer from the first slice on, and is released by the
    first slice's backward."""
    heads, d, lengths = 4, 8, [30, 5]
    context = ChunkContext()
    layers = [make_attention(heads, heads, d, layer_number=i, context=context) for i in (1, 2)]
    chunks = [Chunk(0, "split", [Segment(0, 0, 12)]), Chunk(1, "split", [Segment(0, 12, 20)]),
              Chunk(2, "hybrid", [Segment(1, 0, 5), Segment(0, 20, 30)])]
    sdpa, cat = torch.nn.functional.scaled_dot_product_attention, torch.cat
    outputs, kv_reads, cat_inputs = set(), [], []

    def recording_sdpa(q, k, v, **kwargs):
        buffers = context.kv_storages()
        kv_reads.append(all(t.untyped_storage().data_ptr() in buffers for t in (k, v)))
        out = sdpa(q, k, v, **kwargs)
        outputs.add(out.untyped_storage().data_ptr())
        return out

    def recording_cat(tensors, *args, **kwargs):
        cat_inputs.extend(t.untyped_storage().data_ptr() for t in tensors)
        return cat(tensors, *args, **kwargs)

    flash, merged = attention_kernels._cpu_flash, attention_kernels.prefix_merged_attention

    def recording_flash(q, k, v, *args, **kwargs):  # the merged path's two calls over a slice's prefix and own rows
        buffers = context.kv_storages()
        kv_reads.append(all(t.untyped_storage().data_ptr() in buffers for t in (k, v)))
        return flash(q, k, v, *args, **kwargs)

    def recording_merged(*args, **kwargs):
        out = merged(*args, **kwargs)
        outputs.add(out.untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    monkeypatch.setattr(attention_kernels, "_cpu_flash", recording_flash)
    monkeypatch.setattr(attention_kernels, "prefix_merged_attention", recording_merged)
    monkeypatch.setattr(torch, "cat", recording_cat)
    gen = torch.Generator().manual_seed(0)
    runs = []
    for chunk in chunks:
        view = ChunkView.build(chunk, lengths, torch.device("cpu"))
        qkv = [torch.randn(chunk.num_tokens, 1, heads, d, generator=gen, requires_grad=True) for _ in range(3)]
        with context.running(view):
            runs.append((view, [layer(*qkv) for layer in layers]))
    monkeypatch.undo()
    # per chunk and layer: the first slice (one causal call), the second (prefix and own rows: two calls),
    # then the hybrid's whole sequence (its own K/V) and its tail (two calls)
    assert kv_reads == [True, True] + [True] * 4 + [False, True, True] * 2
    assert cat_inputs and set(cat_inputs) <= outputs
    assert sorted(context.kv) == [(0, 1), (0, 2)] and sum(context.kv_storages().values()) == 2 * 30 * 2 * heads * d * 4
    for view, outs in reversed(runs):
        with context.running(view):
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    assert context.kv == {}


def test_bad_backend_value_is_an_error(monkeypatch):
    monkeypatch.setenv(attention_kernels.ENV, "fast")
    with pytest.raises(ValueError, match=r"EPP_ATTENTION_BACKEND=.fast.: expected one of auto, sdpa, fa4, flash, varlen$"):
        make_attention(4, 4, 8)


def test_flash_requested_without_flash_attn_fails_at_build(monkeypatch):
    use_kernel(monkeypatch, None, "flash-attn does not import (ModuleNotFoundError: No module named 'flash_attn')")
    monkeypatch.setenv(attention_kernels.ENV, "flash")
    with pytest.raises(AttentionBackendError, match=r"EPP_ATTENTION_BACKEND=flash but flash-attn does not import .*No module named"):
        make_attention(4, 4, 8)


def test_flash_attn_older_than_2_1_is_refused(monkeypatch):
    fake = types.ModuleType("flash_attn")
    fake.__version__ = "2.0.9"
    fake.flash_attn_varlen_func = reference_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    kernel, why_not = attention_kernels.load_flash_kernel()
    assert kernel is None and "2.0.9 < 2.1" in why_not and "bottom-right" in why_not
    attention_kernels.reset_flash_probe()
    fake.__version__ = "2.8.3"
    kernel, _ = attention_kernels.load_flash_kernel()
    assert kernel.version == "2.8.3" and kernel.varlen_func is reference_flash_attn_varlen_func


def test_flash_requested_on_cpu_float32_fails_at_first_forward(monkeypatch):
    real_like = FlashKernel(reference_flash_attn_varlen_func, "2.8.3")  # CUDA fp16/bf16 only, like flash-attn
    use_kernel(monkeypatch, real_like)
    monkeypatch.setenv(attention_kernels.ENV, "flash")
    attention = make_attention(4, 4, 8)
    with attention.context.running(ChunkView.build(Chunk(0, "batched", [Segment(0, 0, 4)]), [4], torch.device("cpu"))):
        with pytest.raises(AttentionBackendError, match="flash-attn cannot run: tensors on cpu, flash-attn runs on cuda"):
            attention(*(torch.randn(4, 1, 4, 8) for _ in range(3)))
    with pytest.raises(AttentionBackendError, match="dtype float32, flash-attn takes float16/bfloat16"):
        attention_kernels.select_backend("flash", torch.device("cuda"), torch.float32)


def test_auto_and_sdpa_choices(monkeypatch, capsys):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    use_kernel(monkeypatch, None)
    decided: dict = {}  # a model's record (ChunkContext.attention_backends)
    assert attention_kernels.select_backend("auto", cpu, torch.float32, decided) == "sdpa-merged"
    assert attention_kernels.select_backend("auto", cpu, torch.float32, decided) == "sdpa-merged"  # decided once
    assert attention_kernels.select_backend("auto", cuda, torch.bfloat16, decided) == "sdpa-causal"
    first = capsys.readouterr().out.splitlines()
    assert len(first) == 2  # printed once per decision
    assert first[0] == ("> elastic attention: sdpa-merged (EPP_ATTENTION_BACKEND=auto, cpu float32; no flash: flash-attn does not import (test); "
                        f"no torch varlen: {NO_VARLEN})")
    attention_kernels.reset_flash_probe()
    use_kernel(monkeypatch, FlashKernel(reference_flash_attn_varlen_func, "2.8.3", min_capability=None))
    assert attention_kernels.select_backend("auto", cuda, torch.bfloat16) == "flash-varlen"
    assert attention_kernels.select_backend("auto", cuda, torch.float32) == "sdpa-causal"
    assert attention_kernels.select_backend("auto", cpu, torch.float32) == "sdpa-merged"  # the CPU path stays
    assert attention_kernels.select_backend("auto", torch.device("meta"), torch.float32) == "sdpa-masked"  # neither
    assert attention_kernels.select_backend("sdpa", cuda, torch.bfloat16) == "sdpa-causal"
    lines = capsys.readouterr().out.splitlines()
    assert "> elastic attention: flash-varlen (EPP_ATTENTION_BACKEND=auto, cuda bfloat16; flash-attn 2.8.3)" in lines
    assert ("> elastic attention: sdpa-causal (EPP_ATTENTION_BACKEND=auto, cuda float32; no flash: dtype float32, flash-attn takes float16/bfloat16; "
            f"no torch varlen: {NO_VARLEN}; SDPA per segment, cuDNN attention excluded (a graph per new shape))") in lines
    assert len(lines) == 5  # no record: decided (and printed) at each call


def test_attention_dropout_decides_the_cpu_kernel(monkeypatch, capsys):
    """On CPU attention dropout takes ``sdpa-masked`` (no CPU flash kernel has dropout) and the line says so;
    the same model in evaluation (no dropout) decides, and says, ``sdpa-merged``; CUDA keeps its kernels."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    use_kernel(monkeypatch, None)
    decided: dict = {}
    assert attention_kernels.select_backend("auto", cpu, torch.float32, decided, dropout=0.1) == "sdpa-masked"
    assert attention_kernels.select_backend("auto", cpu, torch.float32, decided, dropout=0.1) == "sdpa-masked"
    assert attention_kernels.select_backend("auto", cpu, torch.float32, decided, dropout=0.0) == "sdpa-merged"
    assert attention_kernels.select_backend("sdpa", cuda, torch.float32, decided, dropout=0.1) == "sdpa-causal"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("> elastic attention: sdpa-masked (EPP_ATTENTION_BACKEND=auto, cpu float32, attention dropout 0.1; "
                        f"no flash: flash-attn does not import (test); no torch varlen: {NO_VARLEN}; "
                        "masked: attention dropout, which the CPU flash kernel has not)")
    assert lines[1].startswith("> elastic attention: sdpa-merged (EPP_ATTENTION_BACKEND=auto, cpu float32; ") and len(lines) == 3
    q = torch.randn(4, 1, 2, 8)
    view = ChunkView.build(Chunk(0, "batched", [Segment(0, 0, 4)]), [4], cpu)
    with pytest.raises(ValueError, match="sdpa-merged has no attention dropout"):
        attention_kernels.sdpa_merged(q, q, q, view, None, 0.1, 1.0)
    # the layer decides with the dropout it runs: its own in training, none in evaluation
    attention = make_attention(2, 2, 8)
    attention.dropout_p = 0.1
    asked = []
    monkeypatch.setattr(elastic_attention.tensor_parallel, "get_cuda_rng_tracker", lambda: types.SimpleNamespace(fork=contextlib.nullcontext))
    monkeypatch.setattr(attention_kernels, "select_backend", lambda *a, dropout=None, **k: asked.append(a[4] if len(a) > 4 else dropout) or "sdpa-merged")
    with attention.context.running(view):
        with pytest.raises(ValueError, match="no attention dropout"):
            attention(q, q, q)
        attention.eval()
        attention(q, q, q)
    assert asked == [0.1, 0.0]


# varlen_attn as torch versions have it (signatures only: the decision reads nothing else of them)
def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                     k_cache=None, v_cache=None, cache_seqlens=None, cache_batch_idx=None, page_table=None, seqused_k=None):
    raise AssertionError("not called")


def varlen_attn_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                     enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    raise AssertionError("not called")


def varlen_attn_without_window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
    raise AssertionError("not called")


NO_WINDOW_OPS = "aten::_flash_attention_forward takes no window_size_left/window_size_right"
TORCHES = {  # name -> (varlen_attn or None, torch version, the aten flash ops as probed)
    "no-varlen": (None, "2.10.0", (REFERENCE_FLASH_OPS, "")),
    "2.11": (varlen_attn_2_11, "2.11.0+cu130", (REFERENCE_FLASH_OPS, "")),
    "2.11-no-aten": (varlen_attn_2_11, "2.11.0+cu130", (None, NO_WINDOW_OPS)),  # a torch whose aten flash ops are not the ones called
    "2.13": (varlen_attn_2_13, "2.13.0", (REFERENCE_FLASH_OPS, "")),
    "no-window": (varlen_attn_without_window, "2.10.0", (REFERENCE_FLASH_OPS, "")),
}
FLASH_BF16 = FlashKernel(reference_flash_attn_varlen_func, "2.8.3", min_capability=None)  # CUDA fp16/bf16, as flash-attn


def probed(torch_name: str):
    func, version, flash_ops = TORCHES[torch_name]
    return attention_kernels.torch_varlen_kernel(func, version, flash_ops, min_capability=None)


def test_torch_varlen_probe_reads_the_signature():
    """What the probe makes of each torch's ``varlen_attn`` and aten flash ops: the GQA mode; this machine's torch
    (2.13) has ``enable_gqa``, and aten flash ops of the schema :class:`AtenFlashVarlen` calls."""
    assert probed("no-varlen") == (None, "torch 2.10.0 has no torch.nn.attention.varlen.varlen_attn")
    assert probed("no-window") == (None, "torch 2.10.0's varlen_attn takes no scale/window_size")
    (k11, why11), (k13, why13), (bare, why_bare) = probed("2.11"), probed("2.13"), probed("2.11-no-aten")
    assert not why11 and not why13 and not why_bare and k11.version == "2.11.0+cu130"
    assert (k11.takes_gqa, k13.takes_gqa, bare.takes_gqa) == (False, True, False)
    assert (k11.gqa_mode, k13.gqa_mode, bare.gqa_mode) == ("aten-flash", "enable_gqa", "expanded")
    assert NO_WINDOW_OPS in bare.gqa_note() and "not count" in bare.gqa_note() and "not expanded" in k11.gqa_note()
    real, why = attention_kernels._probe_torch_varlen()  # the fixture replaced load_torch_varlen, not the probe
    from torch.nn.attention.varlen import varlen_attn
    assert not why and real.varlen_func is varlen_attn and real.version == torch.__version__
    assert real.takes_gqa == (attention_kernels._version_tuple(torch.__version__) >= (2, 13)) and real.devices == ("cuda",)
    assert real.dtypes == (torch.float16, torch.bfloat16) and real.min_capability == (8, 0)
    assert real.flash_ops == attention_kernels.FlashOps(torch.ops.aten._flash_attention_forward.default,
                                                        torch.ops.aten._flash_attention_backward.default) and not real.flash_ops_why


SCHEMA_2_13 = {  # this torch's, as printed by torch.ops.aten._flash_attention_*.default._schema
    "forward": str(torch.ops.aten._flash_attention_forward.default._schema),
    "backward": str(torch.ops.aten._flash_attention_backward.default._schema),
}


def test_aten_flash_op_schemas_are_checked():
    """The aten flash ops are used where their schema takes the call :class:`AtenFlashVarlen` makes (this torch's do);
    a schema without the window arguments, with another positional argument, or other outputs is refused, with why."""
    parse = torch._C.parse_schema
    forward, backward = parse(SCHEMA_2_13["forward"]), parse(SCHEMA_2_13["backward"])
    assert attention_kernels.flash_ops_problem(forward, attention_kernels.FLASH_FORWARD_CALL) == ""
    assert attention_kernels.flash_ops_problem(backward, attention_kernels.FLASH_BACKWARD_CALL) == ""
    assert attention_kernels.load_aten_flash_ops()[1] == ""
    no_window = parse(SCHEMA_2_13["forward"].replace("SymInt? window_size_left=None, SymInt? window_size_right=None, ", ""))
    assert attention_kernels.flash_ops_problem(no_window, attention_kernels.FLASH_FORWARD_CALL) == NO_WINDOW_OPS
    extra = parse(SCHEMA_2_13["backward"].replace("Tensor unused, *", "Tensor unused, Tensor seed2, *"))
    assert attention_kernels.flash_ops_problem(extra, attention_kernels.FLASH_BACKWARD_CALL) == (
        "aten::_flash_attention_backward takes 15 positional arguments and returns 3 (expected 14, 3)")
    fewer = parse(SCHEMA_2_13["forward"].replace(", Tensor debug_attn_mask)", ")"))
    assert "returns 4 (expected 10, 5)" in attention_kernels.flash_ops_problem(fewer, attention_kernels.FLASH_FORWARD_CALL)


def expected_choice(request: str, torch_name: str, device: str, dtype: torch.dtype, flash: bool, dropout: float) -> str:
    """The decision's rules, stated case by case (AttentionBackendError where the request cannot run)."""
    sdpa = {"cpu": "sdpa-masked" if dropout else "sdpa-merged", "cuda": "sdpa-causal"}[device]
    flash_runs = flash and device == "cuda" and dtype == torch.bfloat16
    varlen_runs = torch_name in ("2.11", "2.11-no-aten", "2.13") and device == "cuda" and dtype == torch.bfloat16 and not dropout
    if request == "sdpa":
        return sdpa
    if request == "flash":
        return "flash-varlen" if flash_runs else AttentionBackendError
    if request == "varlen":
        return "torch-varlen" if varlen_runs else AttentionBackendError
    return "flash-varlen" if flash_runs else "torch-varlen" if varlen_runs else sdpa


GRID = list(itertools.product(["auto", "sdpa", "flash", "varlen"], TORCHES, ["cpu", "cuda"], [torch.float32, torch.bfloat16],
                              [False, True], [False, True], [0.0, 0.1]))


GQA_NOTES = {  # torch -> the start-up line's GQA words where torch-varlen runs a model with GQA
    "2.13": "GQA by varlen_attn's enable_gqa, K/V heads not expanded",
    "2.11": "GQA by aten::_flash_attention_forward/backward (varlen_attn has no enable_gqa), K/V heads not expanded",
    "2.11-no-aten": f"K/V heads expanded for GQA (varlen_attn has no enable_gqa; {NO_WINDOW_OPS}): autograd saves the expanded K/V, "
                    "which the memory model does not count",
}


def test_decision_for_every_input():
    """:func:`kernels.decide` over request x torch (no varlen_attn, 2.11 without enable_gqa with and without usable aten
    flash ops, 2.13 with it, one without window_size) x device (cpu, cuda) x dtype (fp32, bf16) x GQA x flash-attn present
    x dropout: the kernel the rules give, and a reason that says why the kernels before it were not taken, and, where
    torch-varlen runs with GQA, how (enable_gqa / aten flash ops, K/V heads not expanded / expanded and not counted)."""
    for request, torch_name, device, dtype, gqa, flash, dropout in GRID:
        case = (request, torch_name, device, dtype, gqa, flash, dropout)
        flash_kernel = (FLASH_BF16, "") if flash else (None, "flash-attn does not import (test)")
        want = expected_choice(request, torch_name, device, dtype, flash, dropout)
        run = lambda: attention_kernels.decide(request, torch.device(device), dtype, dropout, gqa, flash_kernel, probed(torch_name))  # noqa: E731
        if want is AttentionBackendError:
            with pytest.raises(AttentionBackendError, match=f"EPP_ATTENTION_BACKEND={request} but "):
                run()
            continue
        choice, reason = run()
        assert choice == want, case
        notes = [name for name, note in GQA_NOTES.items() if note in reason]
        assert notes == ([torch_name] if choice == "torch-varlen" and gqa else []), (case, reason)
        assert ("K/V heads expanded" in reason) == (notes == ["2.11-no-aten"]) and reason.count("GQA") <= 1, (case, reason)
        if choice == "torch-varlen":
            assert reason.endswith(f"torch {TORCHES[torch_name][1]} varlen_attn, one call per chunk" + (f", {GQA_NOTES[torch_name]}" if gqa else "")), reason
        if choice == "sdpa-causal":
            assert "cuDNN attention excluded" in reason, reason
        if request == "auto" and choice != "flash-varlen":
            assert reason.startswith("no flash: "), reason
            if choice != "torch-varlen":
                why_no_varlen = ("has no torch.nn.attention.varlen.varlen_attn" if torch_name == "no-varlen" else
                                 "takes no scale/window_size" if torch_name == "no-window" else
                                 "tensors on cpu, varlen_attn runs on cuda" if device == "cpu" else
                                 "dtype float32, varlen_attn takes float16/bfloat16" if dtype == torch.float32 else
                                 "attention dropout 0.1, which varlen_attn has not")
                assert "; no torch varlen: " in reason and why_no_varlen in reason, (case, reason)
    assert len(GRID) == 640


def test_cuda_lines_name_the_kernel_and_why(monkeypatch, capsys):
    """The start-up lines on CUDA without flash-attn (torch 2.11: no enable_gqa): torch-varlen in evaluation (GQA through
    the aten flash ops, K/V heads not expanded; where those ops are unusable, expanded and said to be uncounted), SDPA
    without cuDNN under attention dropout and in fp32, each saying why; decided once per (.., dropout, GQA)."""
    cuda = torch.device("cuda")
    use_kernel(monkeypatch, None, "flash-attn does not import (ModuleNotFoundError: No module named 'flash_attn')")
    use_varlen(monkeypatch, probed("2.11")[0])
    decided: dict = {}
    assert attention_kernels.select_backend("auto", cuda, torch.bfloat16, decided, 0.0, gqa=True) == "torch-varlen"
    assert attention_kernels.select_backend("auto", cuda, torch.bfloat16, decided, 0.1, gqa=True) == "sdpa-causal"
    assert attention_kernels.select_backend("auto", cuda, torch.bfloat16, decided, 0.0, gqa=True) == "torch-varlen"  # decided
    assert attention_kernels.select_backend("auto", cuda, torch.bfloat16, decided, 0.0, gqa=False) == "torch-varlen"
    assert attention_kernels.select_backend("auto", cuda, torch.float32, decided, 0.0, gqa=False) == "sdpa-causal"
    use_varlen(monkeypatch, probed("2.11-no-aten")[0])
    assert attention_kernels.select_backend("auto", cuda, torch.bfloat16, None, 0.0, gqa=True) == "torch-varlen"
    no_flash = "no flash: flash-attn does not import (ModuleNotFoundError: No module named 'flash_attn')"
    assert capsys.readouterr().out.splitlines() == [
        f"> elastic attention: torch-varlen (EPP_ATTENTION_BACKEND=auto, cuda bfloat16; {no_flash}; "
        "torch 2.11.0+cu130 varlen_attn, one call per chunk, GQA by aten::_flash_attention_forward/backward (varlen_attn has no "
        "enable_gqa), K/V heads not expanded)",
        f"> elastic attention: sdpa-causal (EPP_ATTENTION_BACKEND=auto, cuda bfloat16, attention dropout 0.1; {no_flash}; "
        "no torch varlen: attention dropout 0.1, which varlen_attn has not; SDPA per segment, cuDNN attention excluded (a graph per new shape))",
        f"> elastic attention: torch-varlen (EPP_ATTENTION_BACKEND=auto, cuda bfloat16; {no_flash}; torch 2.11.0+cu130 varlen_attn, one call per chunk)",
        f"> elastic attention: sdpa-causal (EPP_ATTENTION_BACKEND=auto, cuda float32; {no_flash}; "
        "no torch varlen: dtype float32, varlen_attn takes float16/bfloat16; SDPA per segment, cuDNN attention excluded (a graph per new shape))",
        f"> elastic attention: torch-varlen (EPP_ATTENTION_BACKEND=auto, cuda bfloat16; {no_flash}; "
        f"torch 2.11.0+cu130 varlen_attn, one call per chunk, K/V heads expanded for GQA (varlen_attn has no enable_gqa; {NO_WINDOW_OPS}): "
        "autograd saves the expanded K/V, which the memory model does not count)",
    ]
    assert len(decided) == 4


def test_varlen_request_errors(monkeypatch):
    """``EPP_ATTENTION_BACKEND=varlen``: an error at build where this torch has no usable varlen_attn, at the first
    forward where it cannot take the tensors (CPU here)."""
    use_varlen(monkeypatch, None, "torch 2.10.0 has no torch.nn.attention.varlen.varlen_attn")
    monkeypatch.setenv(attention_kernels.ENV, "varlen")
    with pytest.raises(AttentionBackendError, match=r"^EPP_ATTENTION_BACKEND=varlen but torch 2.10.0 has no torch.nn.attention.varlen.varlen_attn; use"):
        make_attention(4, 4, 8)
    use_varlen(monkeypatch, attention_kernels.torch_varlen_kernel(varlen_attn_2_13, "2.13.0")[0])  # CUDA only, as the real one
    attention = make_attention(4, 4, 8)
    with attention.context.running(ChunkView.build(Chunk(0, "batched", [Segment(0, 0, 4)]), [4], torch.device("cpu"))):
        with pytest.raises(AttentionBackendError, match="varlen_attn cannot run: tensors on cpu, varlen_attn runs on cuda"):
            attention(*(torch.randn(4, 1, 4, 8) for _ in range(3)))


def test_layer_decides_with_its_gqa(monkeypatch):
    """The layer tells the decision whether its query heads share K/V heads (the K/V tensors' head count)."""
    use_varlen(monkeypatch, reference_torch_varlen("expanded"))
    monkeypatch.setenv(attention_kernels.ENV, "varlen")
    for kv_heads in (4, 2):
        attention = make_attention(4, kv_heads, 8)
        with attention.context.running(ChunkView.build(Chunk(0, "batched", [Segment(0, 0, 4)]), [4], torch.device("cpu"))):
            attention(torch.randn(4, 1, 4, 8), torch.randn(4, 1, kv_heads, 8), torch.randn(4, 1, kv_heads, 8))
        assert attention.context.attention_backends == {("varlen", "cpu", torch.float32, False, kv_heads != 4): "torch-varlen"}
