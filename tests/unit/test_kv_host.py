"""K/V buffers on the host (executor/kv_host.py): the block-merged attention equals one attention over the whole
prefix (to rounding), and a plan with kv_host is refused in one line where it cannot run (attention dropout, CUDA).
The bit-for-bit and byte-exact proof runs the real schedule: tests/integration/test_offload_executor.py -k kv_host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_epp.executor import kernels
from megatron_epp.executor.context import bottom_right_causal_mask
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


def _model(dropout: float, device: str = "cpu") -> torch.nn.Module:
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(attention_dropout=dropout)
    if device != "cpu":
        model = model.to("meta")
    return model


def test_kv_host_refused_in_one_line_with_attention_dropout_and_off_cpu():
    _check_kv_host(_model(0.0))  # CPU, no attention dropout: runs
    with pytest.raises(ValueError, match="without attention dropout"):
        _check_kv_host(_model(0.1))
    with pytest.raises(ValueError, match="built on CPU only so far"):
        _check_kv_host(_model(0.0, "meta"))
