"""The tiled MLP (``--epp-mlp-chunk-tokens``, megatron_epp.executor.tiled_mlp): megatron-core's MLP output and gradients
to fp32 rounding in blocks of any size (GELU with biases, the fc2 bias returned apart; SwiGLU without), only the MLP's
input kept for backward, the blocks' recompute not counted as saved activations; a planted fault red; the memory and
time models' counts; the spec wiring, the profile key and bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_epp.cost.activation_memory import gpu_activation_memory, saved_tensor_memory
from megatron_epp.cost.analytic import analytic_profile, shape_time
from megatron_epp.cost.shape import MODEL_PRESETS, ModelShape
from megatron_epp.executor import fused, tiled_mlp
from megatron_epp.measure.profiling import kernel_key
from megatron_epp.model.fused_layers import FusedSwiGLUMLP, TiledFusedSwiGLUMLP, TiledMLP, tiled_mlp_spec
from megatron_epp.model.gpt import architecture_config, elastic_base_layer_spec

S, H, F = 29, 16, 40


@pytest.fixture(autouse=True, scope="module")
def _one_rank():
    """megatron-core's model-parallel state with one tensor-parallel rank (its linear layers' group)."""
    from megatron_epp.measure.layer_bench import init_single_process

    init_single_process()


def _config(swiglu: bool) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=F, use_cpu_initialization=True,
                             gradient_accumulation_fusion=False, bias_activation_fusion=False,
                             **architecture_config(swiglu=swiglu, normalization="LayerNorm", num_query_groups=None,
                                                   kv_channels=None, bias=not swiglu))


def _mlps(swiglu: bool, block: int) -> tuple[MLP, TiledMLP]:
    """megatron-core's MLP and the tiled one with the same weights (random biases where it has them)."""
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    torch.manual_seed(0)
    plain = MLP(_config(swiglu), sub)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.3)
    tiled = TiledMLP(_config(swiglu), sub, mlp_chunk_tokens=block)
    tiled.load_state_dict(plain.state_dict())
    return plain, tiled


def _run(mlp, x, grad):
    x = x.detach().clone().requires_grad_()
    out, bias = mlp(x)
    total = out + bias if bias is not None else out  # the layer's bias-dropout-add adds the fc2 bias megatron-core returns apart
    total.backward(grad)
    return total.detach(), x.grad, {n: p.grad for n, p in mlp.named_parameters()}


def _worst(a, b) -> float:
    (ya, xa, pa), (yb, xb, pb) = a, b
    pairs = [(ya, yb), (xa, xb), *((pa[n], pb[n]) for n in pb)]
    return max(float((p - q).norm() / q.norm()) for p, q in pairs)


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu-bias", "swiglu"])
@pytest.mark.parametrize("block", [1, 4, 7, S, 64])
def test_tiled_mlp_equals_megatron_core_mlp(swiglu, block):
    """Output and every gradient (the input's, fc1's and fc2's weights and biases) within fp32 rounding, whatever the
    block (one row, uneven last block, the whole chunk, more than the chunk)."""
    plain, tiled = _mlps(swiglu, block)
    g = torch.Generator().manual_seed(1)
    x, grad = torch.randn(S, 1, H, generator=g), torch.randn(S, 1, H, generator=g)
    assert _worst(_run(tiled, x, grad), _run(plain, x, grad)) < 1e-5
    assert all(p.grad is not None for p in tiled.parameters())


def test_a_skipped_block_breaks_the_match(monkeypatch):
    """The planted fault: every block's gradients but the first's dropped; the input's and the weights' differ."""
    plain, tiled = _mlps(True, 8)
    block_grads = tiled_mlp._block_grads
    monkeypatch.setattr(tiled_mlp, "_block_grads", lambda first, *rest: tuple(
        None if g is None else g * (first == 0) for g in block_grads(first, *rest)))
    g = torch.Generator().manual_seed(2)
    x, grad = torch.randn(S, 1, H, generator=g), torch.randn(S, 1, H, generator=g)
    assert _worst(_run(tiled, x, grad), _run(plain, x, grad)) > 0.1


def _saved_bytes(mlp, x) -> tuple[int, int]:
    """(bytes the MLP's forward saves for backward, by storage, parameters apart; bytes saved while its backward runs)."""
    saved: dict[int, int] = {}
    during: list[int] = []

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    x = x.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = mlp(x)
        forward = sum(saved.values())
        saved.clear()
        out.sum().backward()
        during.append(sum(saved.values()))
    return forward, during[0]


def test_tiled_mlp_keeps_its_input_alone():
    """The tiled MLP saves its input (``4 h`` bytes a token in fp32) and nothing of fc1's output or the activation
    (megatron-core's SwiGLU MLP saves its input and ``5 f`` values a token: the memory model's counts); its
    blocks' recompute in backward saves nothing a saved-tensor hook sees (the backward's workspace)."""
    plain, tiled = _mlps(True, 8)
    x = torch.randn(S, 1, H)
    assert _saved_bytes(tiled, x) == (4 * S * H, 0)
    assert _saved_bytes(plain, x)[0] == 4 * S * (H + 5 * F)


def test_no_autograd_runs_the_whole_mlp(monkeypatch):
    """Under ``no_grad`` (evaluation) the tiled MLP is megatron-core's, bit for bit, the blocks never taken."""
    from megatron_epp.model import fused_layers

    plain, tiled = _mlps(False, 4)
    x = torch.randn(S, 1, H)
    monkeypatch.setattr(fused_layers, "tiled_mlp", lambda *args: pytest.fail("tiled under no_grad"))
    with torch.no_grad():
        assert torch.equal(tiled(x)[0], plain(x)[0])


def test_memory_models_drop_the_mlp_activations():
    """The GPU count (Megatron's ``34 h / tp``) loses the MLP's fc1 output, activation and fc2 input (``4 f + 2 f`` with
    SwiGLU, bf16), the CPU count its ``5 b f`` (SwiGLU) or ``2 b f`` (GELU); nothing else changes."""
    shape = MODEL_PRESETS["llama-7b"]
    tiled = dataclasses.replace(shape, mlp_chunk_tokens=8192)
    for tp in (1, 8):
        plain, less = gpu_activation_memory(shape, tp), gpu_activation_memory(tiled, tp)
        assert plain["act_token"] - less["act_token"] == pytest.approx(6 * shape.ffn_hidden * 2 / 2 / tp)
        assert {k: v for k, v in plain.items() if k != "act_token"} == {k: v for k, v in less.items() if k != "act_token"}
    for swiglu, values in ((True, 5), (False, 2)):
        small = ModelShape("t", 1, H, 4, F, 64, swiglu=swiglu)
        plain, less = saved_tensor_memory(small), saved_tensor_memory(dataclasses.replace(small, mlp_chunk_tokens=8))
        assert plain["act_token"] - less["act_token"] == values * 4 * F


def test_time_model_charges_one_mlp_forward_in_backward():
    """The analytic profile's backward gains the MLP's forward GEMMs (``2 k h f`` FLOPs a token at the GEMMs' rate);
    carrying a profile to or from the tiled shape adds or removes exactly that, the forward unchanged."""
    shape = MODEL_PRESETS["llama-7b"]
    tiled = dataclasses.replace(shape, mlp_chunk_tokens=8192)
    plain, fresh = analytic_profile(shape), analytic_profile(tiled)
    ms_per_flop = plain.head_fwd.a2 / (2.0 * shape.hidden * shape.vocab)
    assert fresh.bwd.a2 - plain.bwd.a2 == pytest.approx(2 * 3 * shape.hidden * shape.ffn_hidden * ms_per_flop)
    assert fresh.fwd == plain.fwd
    assert shape_time(dataclasses.replace(plain, model=tiled)).bwd.a2 == pytest.approx(fresh.bwd.a2)
    assert shape_time(dataclasses.replace(fresh, model=shape)).bwd.a2 == pytest.approx(plain.bwd.a2)


def test_spec_wiring_and_bad_input():
    """0 leaves the spec as it is (the same object); N makes megatron-core's MLP (or the fused SwiGLU one) tiled with
    the block, the spec given unchanged; an MLP of another kind is a one-line error; a block below 1 too."""
    spec = elastic_base_layer_spec("RMSNorm")
    assert tiled_mlp_spec(spec, 0) is spec
    tiled = tiled_mlp_spec(spec, 512)
    assert tiled.submodules.mlp.module is TiledMLP and tiled.submodules.mlp.params["mlp_chunk_tokens"] == 512
    assert spec.submodules.mlp.module is MLP and "mlp_chunk_tokens" not in spec.submodules.mlp.params
    spec.submodules.mlp.module = FusedSwiGLUMLP
    assert tiled_mlp_spec(spec, 8).submodules.mlp.module is TiledFusedSwiGLUMLP
    spec.submodules.mlp = ModuleSpec(module=torch.nn.Identity)
    with pytest.raises(ValueError, match="tiles megatron-core's dense MLP"):
        tiled_mlp_spec(spec, 8)
    with pytest.raises(ValueError, match="give at least 1"):
        _mlps(False, 0)


def test_profile_key_names_the_block():
    """A profile measured with the tiled MLP is its own key (a layer's time and memory differ)."""
    assert kernel_key("sdpa", fused.UNFUSED, 0, 8192) == "sdpa+tiled-mlp=8192"
    assert kernel_key("sdpa", fused.UNFUSED, 4096, 8192) == "sdpa+chunked-ce=4096+tiled-mlp=8192"
    assert kernel_key("sdpa", fused.UNFUSED) == "sdpa"
