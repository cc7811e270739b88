"""The chunked output head (``--epp-loss-chunk-tokens``, megatron_epp.executor.chunked_loss): megatron-core's per-token
loss and gradients to fp32 rounding in blocks of any size, under a loss mask (SFT: masked tokens weigh 0), a planted
fault red, nothing of the logits kept; the memory model's count; the profiler's head; the wiring and bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core import tensor_parallel

from megatron_epp.cost.activation_memory import CHUNKED_HEAD_TOKEN, gpu_activation_memory, saved_tensor_memory
from megatron_epp.cost.analytic import analytic_profile, shape_time
from megatron_epp.cost.shape import MODEL_PRESETS, ModelShape
from megatron_epp.executor import chunked_loss
from megatron_epp.measure.profiling import kernel_key
from megatron_epp.executor import fused

S, H, V = 45, 24, 200
SHAPE = ModelShape("chunked-test", 1, H, 4, 64, V, normalization="RMSNorm", swiglu=True, bias=False)


@pytest.fixture(autouse=True, scope="module")
def _one_rank():
    """megatron-core's model-parallel state with one tensor-parallel rank (its cross entropy all-reduces over it)."""
    from megatron_epp.measure.layer_bench import init_single_process

    init_single_process()


def _reference(x, weight, labels, mask):
    """megatron-core's head: the output layer's logits whole, its vocab-parallel cross entropy (TP 1), the loss mask."""
    losses = tensor_parallel.vocab_parallel_cross_entropy(torch.matmul(x, weight.t()), labels)
    return (losses * mask).sum()


def _run(head, x, weight, labels, mask):
    x, weight = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = head(x, weight, labels, mask)
    loss.backward()
    return loss.detach(), x.grad, weight.grad


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(S, 1, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    labels = torch.randint(0, V, (S, 1), generator=g)
    mask = (torch.rand(S, 1, generator=g) > 0.3).float()  # an SFT-like loss mask: about 30 % of the tokens weigh 0
    return x, weight, labels, mask


def _chunked(block: int):
    return lambda x, weight, labels, mask: (chunked_loss.chunked_linear_cross_entropy(x, weight, labels, block) * mask).sum()


def _worst(a, b) -> float:
    return max(float((p - q).norm() / q.norm()) for p, q in zip(a, b))


@pytest.mark.parametrize("block", [1, 7, 16, S, 4 * S])
def test_loss_and_gradients_equal_megatron_cores_head_to_fp32_rounding(block):
    """Loss, hidden-state and output-weight gradients within fp32 rounding (not bitwise: the blocks' matmuls and the
    weight gradient's block-wise sum round in another order), under a loss mask."""
    x, weight, labels, mask = _case()
    expected = _run(_reference, x, weight, labels, mask)
    got = _run(_chunked(block), x, weight, labels, mask)
    assert _worst(got, expected) < 2e-6
    assert torch.equal(got[1][mask[:, 0] == 0], torch.zeros_like(got[1][mask[:, 0] == 0]))  # masked tokens: no gradient


def test_a_skipped_block_gradient_or_another_blocks_log_sum_exp_goes_red(monkeypatch):
    x, weight, labels, mask = _case(1)
    expected = _run(_reference, x, weight, labels, mask)
    block_grad = chunked_loss._block_grad
    monkeypatch.setattr(chunked_loss, "_block_grad", lambda first, *rest: block_grad(first, *rest) * (first != 8))
    assert _worst(_run(_chunked(8), x, weight, labels, mask)[1:], expected[1:]) > 1e-2
    monkeypatch.setattr(chunked_loss, "_block_grad", lambda first, x, w, lse, *rest: block_grad(first, x, w, lse.roll(3), *rest))
    assert _worst(_run(_chunked(8), x, weight, labels, mask)[1:], expected[1:]) > 1e-2


def test_the_forward_keeps_the_input_targets_and_log_sum_exp_never_the_logits():
    saved = []

    def pack(t):
        saved.append((t.untyped_storage().nbytes(), isinstance(t, torch.nn.Parameter)))
        return t

    x, weight, labels, _ = _case()
    x.requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_loss.chunked_linear_cross_entropy(x, torch.nn.Parameter(weight), labels, 8)
    assert sorted(n for n, param in saved if not param) == sorted([S * H * 4, S * 4, S * 4])  # hidden, int32 targets, lse


def test_a_block_below_one_token_is_one_line():
    x, weight, labels, _ = _case()
    with pytest.raises(ValueError, match="block of 0 tokens"):
        chunked_loss.chunked_linear_cross_entropy(x, weight, labels, 0)


@pytest.mark.parametrize("tp, sp, cp", [(1, False, 1), (2, True, 1), (2, True, 2)])
def test_the_memory_model_counts_the_heads_input_and_twelve_bytes_a_token(tp, sp, cp):
    """Saved tensors (CPU): the final norm's, the head's input (this rank's share), target, log-sum-exp and loss mask;
    Megatron's GPU count: the bf16 input and the same 12 bytes, where the whole chunk's fp32 logits were 4 V / tp."""
    chunked = dataclasses.replace(SHAPE, loss_chunk_tokens=32)
    plain, ours = saved_tensor_memory(SHAPE, tp, sp, cp), saved_tensor_memory(chunked, tp, sp, cp)
    share = (tp if sp else 1) * cp
    assert plain["logits_token"] - ours["logits_token"] == pytest.approx((4 * V / tp + 13) / cp - CHUNKED_HEAD_TOKEN / cp)
    assert {k: v for k, v in ours.items() if k != "logits_token"} == {k: v for k, v in plain.items() if k != "logits_token"}
    assert ours["logits_token"] == (8 * H + 4) / share + 4 * H / share + 12 / cp  # RMSNorm's fp32 saves, the input, 12 B
    llama = dataclasses.replace(MODEL_PRESETS["llama-7b"], loss_chunk_tokens=4096)
    assert gpu_activation_memory(llama, 8)["logits_token"] == 2 * 4096 / 8 + CHUNKED_HEAD_TOKEN  # was 16,000 B at TP 8


def test_the_chunked_heads_backward_is_charged_its_recomputed_logits():
    """Analytic: the head's backward GEMMs plus one forward's; carried from an unchunked profile, the same."""
    llama = MODEL_PRESETS["llama-7b"]
    chunked = dataclasses.replace(llama, loss_chunk_tokens=4096)
    plain, ours = analytic_profile(llama), analytic_profile(chunked)
    assert ours.head_bwd.a2 == pytest.approx(plain.head_bwd.a2 + plain.head_fwd.a2)
    assert shape_time(dataclasses.replace(plain, model=chunked)).head_bwd.a2 == pytest.approx(ours.head_bwd.a2)
    assert shape_time(dataclasses.replace(ours, model=llama)).head_bwd.a2 == pytest.approx(plain.head_bwd.a2)


def test_the_profilers_head_is_the_chunked_one_and_keeps_what_the_memory_model_counts():
    """LayerStack.head_loss with the shape's ``loss_chunk_tokens`` runs the run's head: the same loss and input gradient
    as the unchunked head to fp32 rounding, and the saved bytes a token ``logits_token`` of the saved-tensor count."""
    from megatron_epp.measure.layer_bench import saved_bytes
    from megatron_epp.measure.profiling import LayerStack

    chunked = dataclasses.replace(SHAPE, loss_chunk_tokens=16)
    plain, ours = LayerStack(SHAPE, 1, seed=0), LayerStack(chunked, 1, seed=0)
    x = torch.randn(S, 1, H)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = plain.head_loss(a), ours.head_loss(b)
    expected.backward(), got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)
    n = 256
    kept = saved_bytes(lambda: ours.head_loss(torch.randn(n, 1, H, requires_grad=True)))
    assert kept == n * saved_tensor_memory(chunked)["logits_token"]
    assert kept < saved_bytes(lambda: plain.head_loss(torch.randn(n, 1, H, requires_grad=True)))


def test_the_profile_key_says_the_chunked_head():
    assert kernel_key("sdpa", fused.UNFUSED, 4096) == "sdpa+chunked-ce=4096" and kernel_key("sdpa", fused.UNFUSED) == "sdpa"


def test_the_option_builds_the_chunked_head_over_a_fused_cross_entropy():
    from megatron_epp.config.parser import parse_config
    from megatron_epp.model.fused_layers import ChunkedLossGPTModel, FusedLossGPTModel
    from megatron_epp.model.gpt import head_model, model_shape

    cfg = parse_config(["--mock-data", "--epp-loss-chunk-tokens", "512"])
    assert head_model(cfg, fused.FusedChoice(cross_entropy="compile")) == (ChunkedLossGPTModel, {"loss_chunk_tokens": 512})
    assert model_shape(cfg).loss_chunk_tokens == 512
    off = parse_config(["--mock-data"])
    assert head_model(off, fused.FusedChoice(cross_entropy="compile"))[0] is FusedLossGPTModel
    assert model_shape(off).loss_chunk_tokens == 0
