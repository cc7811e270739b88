"""K/V buffers on the host (executor/kv_host.py): the block-merged attention equals one attention over the whole
prefix (to rounding); the CUDA block kernel's code (kernels.BlockFlashKernel, here over the reference aten flash ops on
CPU in float32) gives the CPU block path's values and gradients; a plan with kv_host is refused in one line where it
cannot run (attention dropout; no block kernel: off CPU and CUDA, fp32 on CUDA, no aten flash ops). The bit-for-bit and
byte-exact proof runs the real schedule: tests/integration/test_offload_executor.py -k kv_host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.attention_harness import REFERENCE_BLOCK_FLASH, REFERENCE_FLASH_OPS, make_attention
from megatron_epp.executor import kernels
from megatron_epp.executor.context import ChunkView, bottom_right_causal_mask, sequence_slices
from megatron_epp.plan import Chunk, Pipeline, Segment
from megatron_epp.plan.core import chunk_kind
from megatron_epp.plan.order import backward_order
from megatron_epp.executor.schedule import _check_kv_host


@pytest.mark.parametrize("blocks", [((0, 7),), ((0, 3), (3, 7)), ((0, 1), (1, 5), (5, 7))])
def test_block_merged_attention_equals_one_attention_over_the_prefix(blocks):
    gen = torch.Generator().manual_seed(0)
    s, context, heads, kv_heads, d = 5, 7, 4, 2, 8
    q = torch.randn(1, heads, s, d, generator=gen, dtype=torch.float64).float().requires_grad_()
    k, v = (torch.randn(1, kv_heads, context + s, d, generator=gen).requires_grad_() for _ in range(2))
    out = kernels.PrefixMergedAttention.apply(q, k, v, blocks, 0.3)
    mask = bottom_right_causal_mask(s, context)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    grad = torch.randn(out.shape, generator=gen)
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for got, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def _model(dropout: float, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = torch.nn.Linear(2, 2).to(dtype)
    model.config = SimpleNamespace(attention_dropout=dropout)
    if device != "cpu":
        model = model.to("meta")
    return model


def test_kv_host_refused_in_one_line_with_attention_dropout_and_without_a_block_kernel(monkeypatch):
    _check_kv_host(_model(0.0))  # CPU, no attention dropout: runs
    with pytest.raises(ValueError, match="without attention dropout"):
        _check_kv_host(_model(0.1))
    with pytest.raises(ValueError, match=r"cannot run on meta \(tensors on meta, the block kernel \(aten flash ops\) runs on cuda\)$"):
        _check_kv_host(_model(0.0, "meta"))
    monkeypatch.setattr(kernels, "load_block_flash", lambda: (None, "torch 9.9 has no aten flash ops"))
    with pytest.raises(ValueError, match=r"cannot run on meta \(torch 9.9 has no aten flash ops\)$"):
        _check_kv_host(_model(0.0, "meta"))
    _check_kv_host(_model(0.0))  # CPU needs no aten flash ops


def test_block_kernel_taken_on_cuda_in_half_precision_refused_in_fp32(monkeypatch):
    monkeypatch.setattr(kernels, "load_block_flash", lambda: (kernels.BlockFlashKernel(REFERENCE_FLASH_OPS, min_capability=None), ""))
    cuda = torch.device("cuda", 0)
    for dtype in (torch.bfloat16, torch.float16):
        assert kernels.block_kernel(cuda, dtype).ops is REFERENCE_FLASH_OPS and kernels.block_kernel_problem(cuda, dtype) == ""
    with pytest.raises(kernels.AttentionBackendError, match=r"on cuda: the block attention cannot run \(dtype float32, .* takes float16/bfloat16\)$"):
        kernels.block_kernel(cuda, torch.float32)
    assert kernels.block_kernel(torch.device("cpu"), torch.float32) is None  # CPU: the CPU flash kernel, as before
    assert kernels.block_kernel(torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setattr(kernels, "load_block_flash", lambda: (REFERENCE_BLOCK_FLASH, ""))
    assert kernels.block_kernel(torch.device("cpu"), torch.float32) is REFERENCE_BLOCK_FLASH  # where a kernel takes CPU (tests)


class _Faulty:
    """The reference ops with one planted fault of the block path: ``wrong-lse`` (every block's backward given the
    log-sum-exp of the first block's forward, not the merged one) or ``dk-dropped`` (a prefix block's key gradient zero)."""

    def __init__(self, fault: str) -> None:
        self.fault, self.first_lse = fault, None

    def forward(self, *args, **kwargs):
        result = REFERENCE_FLASH_OPS.forward(*args, **kwargs)
        if self.first_lse is None:
            self.first_lse = result[1]
        return result

    def backward(self, grad_out, q, k, v, out, lse, *args, **kwargs):
        if self.fault == "wrong-lse":
            lse = self.first_lse
        dq, dk, dv = REFERENCE_FLASH_OPS.backward(grad_out, q, k, v, out, lse, *args, **kwargs)
        if self.fault == "dk-dropped" and not args[5]:  # is_causal False: a prefix block
            dk = torch.zeros_like(dk)
        return dq, dk, dv


BLOCKS = ((0, 3), (3, 4), (4, 9))  # three prefix blocks (one of a single row), then the own block


def _block_path(kernel, heads: int, kv_heads: int, b: int) -> dict[str, torch.Tensor]:
    """Values and gradients of one slice (5 queries) over :data:`BLOCKS` and its own rows through
    ``kernels.merged_forward``/``merged_backward`` with ``kernel`` (None: the CPU flash kernel)."""
    gen = torch.Generator().manual_seed(3)
    s, d, context = 5, 8, BLOCKS[-1][1]
    q = torch.randn(b, heads, s, d, generator=gen)
    k, v = (torch.randn(context + s, b, kv_heads, d, generator=gen) for _ in range(2))  # a window's [rows, b, kv_heads, d]
    parts = [(k[a:e].permute(1, 2, 0, 3), v[a:e].permute(1, 2, 0, 3), False) for a, e in BLOCKS]
    parts.append((k[context:].permute(1, 2, 0, 3), v[context:].permute(1, 2, 0, 3), True))
    out, lse = kernels.merged_forward(q, iter(parts), 0.35, kernel)
    grad_out = torch.randn(out.shape, generator=gen)
    grads: dict[int, tuple] = {}
    dq = kernels.merged_backward(grad_out, q, out, lse, iter(parts), 0.35, lambda i, gk, gv: grads.__setitem__(i, (gk, gv)), kernel)
    assert sorted(grads) == list(range(len(parts)))
    return {"out": out, "lse": lse, "dq": dq, "dk": torch.cat([grads[i][0] for i in sorted(grads)], dim=2),
            "dv": torch.cat([grads[i][1] for i in sorted(grads)], dim=2)}


@pytest.mark.parametrize("heads, kv_heads, b", [(4, 2, 1), (4, 4, 1), (6, 2, 2)])
def test_cuda_block_path_equals_the_cpu_block_path(heads, kv_heads, b):
    """GQA and MHA, one sequence and two (two varlen sequences per call): values, log-sum-exp, q/k/v gradients."""
    cpu, flash = _block_path(None, heads, kv_heads, b), _block_path(REFERENCE_BLOCK_FLASH, heads, kv_heads, b)
    assert flash["dk"].shape == (b, kv_heads, BLOCKS[-1][1] + 5, 8)
    for name in cpu:
        torch.testing.assert_close(flash[name], cpu[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("fault, broken", [("wrong-lse", ("dq", "dk", "dv")), ("dk-dropped", ("dk",))])
def test_planted_block_path_faults_break_the_match(fault, broken):
    faulty = _Faulty(fault)
    kernel = kernels.BlockFlashKernel(kernels.FlashOps(faulty.forward, faulty.backward), devices=("cpu",), dtypes=(torch.float32,),
                                      min_capability=None)
    cpu, flash = _block_path(None, 4, 2, 1), _block_path(kernel, 4, 2, 1)
    torch.testing.assert_close(flash["out"], cpu["out"], rtol=1e-5, atol=1e-5)  # the forward is untouched
    for name in broken:
        assert (flash[name] - cpu[name]).abs().max() > 1e-3, f"{fault}: {name} unchanged"


def _host_slices(kv_heads: int) -> list[tuple[torch.Tensor, ...]]:
    """Sequence 0 (12 tokens) split in three slices, the last packed after sequence 1 (3 tokens), its K/V buffer on the
    host, through one ElasticAttention as the schedule runs it: each chunk's output and q/k/v gradients."""
    lengths = [12, 3]
    segments = [[Segment(0, 0, 4)], [Segment(0, 4, 7)], [Segment(1, 0, 3), Segment(0, 7, 12)]]
    pipe = Pipeline([Chunk(i, chunk_kind(seg, lengths), seg) for i, seg in enumerate(segments)], [[0, 0, 0]], kv_host=[0])
    attention = make_attention(4, kv_heads, 8)
    context, gen = attention.context, torch.Generator().manual_seed(5)
    views = [ChunkView.build(c, lengths, torch.device("cpu"), slices=sequence_slices(pipe.chunks, lengths), kv_host={0}) for c in pipe.chunks]
    assert all(v.kv_host for v in views)
    leaves, outs = [], []
    with context.step():
        for view, chunk in zip(views, pipe.chunks):
            q, k, v = (torch.randn(chunk.num_tokens, 1, h, 8, generator=gen).requires_grad_() for h in (4, kv_heads, kv_heads))
            leaves.append((q, k, v))
            with context.running(view):
                outs.append(attention(q, k, v, attention_mask=None))
        for pos in backward_order(pipe):
            with context.running(views[pos]):
                outs[pos].backward(torch.randn(outs[pos].shape, generator=gen))
    assert not context.host_kv.layers and not context.host_kv.windows  # every host buffer and window released
    return [(o.detach(), q.grad, k.grad, v.grad) for o, (q, k, v) in zip(outs, leaves)]


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_host_slice_attention_through_the_cuda_block_kernel_equals_the_cpu_one(monkeypatch, kv_heads):
    """ElasticAttention with a kv_host sequence: the block kernel ``kernels.block_kernel`` picks (here the reference aten
    ops, as on CUDA) gives the CPU flash kernel's outputs and q/k/v gradients of every chunk."""
    cpu = _host_slices(kv_heads)
    monkeypatch.setattr(kernels, "load_block_flash", lambda: (REFERENCE_BLOCK_FLASH, ""))
    calls = []
    monkeypatch.setattr(kernels.BlockFlashKernel, "pack_merged", lambda self, *a, _pack=kernels.BlockFlashKernel.pack_merged: calls.append(1) or _pack(self, *a))
    flash = _host_slices(kv_heads)
    assert len(calls) == 3  # every slice's backward through the block kernel
    for chunk_cpu, chunk_flash in zip(cpu, flash):
        for want, got in zip(chunk_cpu, chunk_flash):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cuda_check_script_dry_run_passes_through_the_block_kernel(monkeypatch, capsys):
    """benchmarks/check_kv_host_cuda.py (the GPU check of kv_host against the device buffer) runs on CPU over the
    reference ops and passes; its kv_host run took the block kernel (errors not 0, the device buffer's are)."""
    from benchmarks import check_kv_host_cuda

    monkeypatch.setattr(kernels, "load_block_flash", kernels.load_block_flash)  # restored after the dry run's override
    assert check_kv_host_cuda.main(["--cpu-dry-run"]) == 0
    out = capsys.readouterr().out
    assert "block kernel: BlockFlashKernel" in out and out.rstrip().endswith("check_kv_host_cuda: passed")
    assert "out: kv_host 0.00e+00" not in out
