"""The fused pointwise kernels (megatron_epp.executor.fused, megatron_epp.model.fused_layers): the selection (a
library present, absent, failing its probe, on the wrong device, its flag off), the profile key, the spec wiring, the
torch.compile path on the CPU (exact to fp32 rounding, one graph for every chunk length) and the liger/quack adapters'
plumbing against fake libraries that implement the documented semantics in torch."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from megatron.core.transformer.mlp import MLP

from megatron_epp.cost.profile_lookup import ProfileKey
from megatron_epp.cost.shape import ModelShape
from megatron_epp.executor import fused
from megatron_epp.measure.profile_resolution import Target
from megatron_epp.measure.profiling import kernel_key
from megatron_epp.model import fused_layers
from megatron_epp.model.gpt import TorchNorm, decoder_spec, fused_choice, fused_flags, local_layer_spec
from megatron_epp.config.parser import parse_config

BF16 = torch.bfloat16
SHAPE = ModelShape("fused-test", 1, 64, 4, 96, 128, num_kv_heads=2, swiglu=True, normalization="RMSNorm", bias=False, rope=True)


def library(name: str, ops=fused.OPS, min_capability=(8, 0)) -> fused.KernelLibrary:
    return fused.KernelLibrary(name, "1.0", {op: (lambda *a: a) if op in ops else None for op in fused.OPS},
                               min_capability=min_capability)


LIGER = (library("liger"), "")
QUACK = (library("quack", ("norm", "rope", "cross_entropy"), (9, 0)), "")
ABSENT = {"liger": (None, "liger-kernel does not import (ModuleNotFoundError)"), "quack": (None, "quack-kernels does not import")}
AUTO = fused.parse_request("auto")


def decide(request=AUTO, flags=fused.FusedFlags(), device="cuda", libraries=None, compiler=(True, ""), capability=(9, 0)):
    return fused.decide(request, flags, device, BF16, libraries if libraries is not None else {"liger": LIGER, "quack": QUACK},
                        compiler, capability)


# --- the selection -------------------------------------------------------------------------------------------------

def test_on_the_cpu_auto_is_todays_path_whatever_is_installed():
    choice = decide(device="cpu", capability=None)
    assert choice == fused.UNFUSED and not choice.fused() and choice.tag() == ""
    assert "cpu: today's unfused modules" in choice.line()
    assert fused.select(AUTO, fused.FusedFlags(cross_entropy_loss_fusion=True), torch.device("cpu"), torch.float32) == fused.UNFUSED


def test_on_cuda_auto_takes_the_first_library_that_runs_and_the_flags_as_megatron_lm():
    assert decide() == fused.FusedChoice("liger", "liger", "liger", "torch")  # cross entropy: only with the flag
    assert decide(flags=fused.FusedFlags(cross_entropy_loss_fusion=True)).cross_entropy == "liger"
    off = decide(flags=fused.FusedFlags(rope_fusion=False, bias_swiglu_fusion=False))
    assert (off.swiglu, off.rope) == ("torch", "torch") and "--no-rope-fusion" in off.line() and "--no-bias-swiglu-fusion" in off.line()


def test_absent_failing_or_too_old_libraries_fall_through_with_their_reasons():
    no_liger = decide(libraries={"liger": ABSENT["liger"], "quack": QUACK})
    assert no_liger == fused.FusedChoice("quack", "compile", "quack", "torch")  # quack has no SwiGLU kernel
    hopper_less = decide(libraries={"liger": ABSENT["liger"], "quack": QUACK}, capability=(8, 0))
    assert (hopper_less.norm, hopper_less.rope) == ("compile", "compile")
    nothing = decide(libraries=ABSENT, compiler=(None, "no usable Triton"))
    assert nothing == fused.UNFUSED and "liger-kernel does not import" in nothing.line() and "no usable Triton" in nothing.line()


def test_a_library_asked_by_name_that_cannot_run_is_one_line_error():
    with pytest.raises(fused.FusedKernelError, match="norm=liger, which cannot run: tensors on cpu"):
        decide(fused.parse_request("norm=liger"), device="cpu", capability=None)
    with pytest.raises(fused.FusedKernelError, match="does not import"):
        decide(fused.parse_request("quack"), libraries=ABSENT)
    with pytest.raises(fused.FusedKernelError, match="rope=compile, but --no-rope-fusion: give one"):
        decide(fused.parse_request("rope=compile"), flags=fused.FusedFlags(rope_fusion=False))
    blanket = decide(fused.parse_request("compile"), flags=fused.FusedFlags(rope_fusion=False), device="cpu", capability=None)
    assert blanket == fused.FusedChoice("compile", "compile", "torch", "torch")  # the flags still turn their ops off


def test_the_cross_entropy_at_tp_above_one_is_vocab_parallel_or_unfused():
    flags = fused.FusedFlags(cross_entropy_loss_fusion=True, tp=2)
    assert decide(flags=flags).cross_entropy == "compile"  # megatron-core's fused vocab-parallel one
    assert decide(flags=flags, compiler=(None, "no Triton")).cross_entropy == "torch"


def test_the_request_is_parsed_and_a_bad_one_refused():
    assert fused.parse_request(None) == dict.fromkeys(fused.OPS, "auto")
    assert fused.parse_request("norm=liger, ce=quack") == {"norm": "liger", "swiglu": "auto", "rope": "auto", "cross_entropy": "quack"}
    with pytest.raises(ValueError, match="EPP_FUSED_KERNELS='triton'"):
        fused.parse_request("triton")


def test_megatron_lm_flags_are_options_with_megatron_lm_defaults():
    default = parse_config(["--mock-data", "--swiglu", "--normalization", "RMSNorm"], world_size=1)
    assert fused_flags(default, elastic=True) == fused.FusedFlags()
    given = parse_config(["--mock-data", "--no-rope-fusion", "--no-bias-swiglu-fusion", "--cross-entropy-loss-fusion",
                          "--no-persist-layer-norm"], world_size=1)
    assert fused_flags(given, elastic=False) == fused.FusedFlags(False, False, True, rms_norm=False, swiglu=False, rope=False)
    assert given.accepted_flags == ("--no-persist-layer-norm",)


# --- the profile key -----------------------------------------------------------------------------------------------

def test_the_fused_kernels_enter_the_profile_key_and_unfused_keeps_the_old_key():
    plain = Target("cuda", BF16, "NVIDIA H200", "flash-varlen")
    liger = dataclasses.replace(plain, fused_kernels=fused.FusedChoice("liger", "liger", "quack", "torch"))
    assert plain.key(SHAPE, 4096).kernel == "flash-varlen"
    assert liger.key(SHAPE, 4096) != plain.key(SHAPE, 4096)
    assert liger.key(SHAPE, 4096).file_name() != plain.key(SHAPE, 4096).file_name()
    tag = liger.key_kernel
    assert tag == kernel_key("flash-varlen", liger.fused_kernels) == "flash-varlen+fused:norm=liger;swiglu=liger;rope=quack;ce=torch"
    profile = types.SimpleNamespace(source="measured", device=f"NVIDIA H200 (bf16, {tag})", fit={"torch": "2.13", "seq_length": 4096},
                                    time_model=SHAPE)
    assert ProfileKey.from_profile(profile) == dataclasses.replace(liger, torch_version="2.13").key(SHAPE, 4096)


# --- the spec wiring -----------------------------------------------------------------------------------------------

def test_the_cpu_default_builds_exactly_todays_modules():
    cfg = parse_config(["--mock-data", "--swiglu", "--normalization", "RMSNorm", "--elastic-pp"], world_size=1)
    choice = fused_choice(cfg, torch.device("cpu"), elastic=True)
    assert choice == fused.UNFUSED
    spec = local_layer_spec("RMSNorm")
    assert fused_layers.fused_layer_spec(spec, choice) is spec  # the same object: nothing rebuilt
    assert spec.submodules.input_layernorm is TorchNorm and spec.submodules.mlp.module is MLP


def test_a_fused_choice_puts_its_modules_in_the_spec():
    choice = fused.FusedChoice("compile", "compile", "torch", "torch")
    spec = fused_layers.fused_layer_spec(local_layer_spec("RMSNorm", qk_layernorm=True), choice)
    layer = spec.submodules
    for norm in (layer.input_layernorm, layer.pre_mlp_layernorm, layer.self_attention.submodules.q_layernorm):
        assert norm.module is fused_layers.FusedNorm and norm.params == {"backend": "compile"}
    assert layer.mlp.module is fused_layers.FusedSwiGLUMLP and layer.mlp.params["swiglu_backend"] == "compile"
    assert local_layer_spec("RMSNorm").submodules.mlp.module is MLP  # the base spec is not changed
    with pytest.raises(ValueError, match="elastic layers"):
        fused_layers.fused_layer_spec(local_layer_spec("RMSNorm"), fused.FusedChoice(rope="compile"))



def test_the_final_norm_is_the_layers_fused_norm():
    from megatron.core.transformer import TransformerConfig
    from megatron_epp.measure.layer_bench import init_single_process

    init_single_process()  # the pipeline group decoder_spec counts this stage's layers by
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm")
    spec = fused_layers.fused_layer_spec(local_layer_spec("RMSNorm"), fused.FusedChoice(norm="compile"))
    assert decoder_spec(spec, config).layer_norm is spec.submodules.input_layernorm
    assert decoder_spec(local_layer_spec("RMSNorm"), config).layer_norm is TorchNorm


# --- the torch.compile path on the CPU ----------------------------------------------------------------------------

def _inputs(op: str, tokens: int, generator: torch.Generator) -> tuple:
    def randn(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    if op == "norm":
        return randn(tokens, 1, 64), randn(64), 1e-5, 0.0
    if op == "swiglu":
        return (randn(tokens, 1, 2 * 96),)
    if op == "rope":
        angles = torch.rand(tokens, 1, 1, 8, generator=generator) * tokens
        angles = torch.cat((angles, angles), dim=-1)  # megatron-core's duplicated halves
        return randn(tokens, 1, 4, 32), randn(tokens, 1, 2, 32), torch.cos(angles), torch.sin(angles)  # partial RoPE: 16 of 32
    return randn(tokens, 1, 128), torch.randint(0, 128, (tokens, 1), generator=generator)


def _run(function, inputs):
    outputs = function(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    sum(o.float().square().sum() for o in outputs).backward()
    grads = [t.grad.clone() for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    for t in inputs:
        if isinstance(t, torch.Tensor):
            t.grad = None
    return [o.detach() for o in outputs], grads


@pytest.mark.parametrize("op", fused.OPS)
def test_the_compiled_op_equals_the_unfused_one_with_one_graph_for_every_length(op):
    """fp32 to 2e-6 relative: inductor's vectorised reductions and fused multiply-adds round differently from eager
    (measured: up to 1e-6 on these shapes); one graph for the three token counts (dynamic=True)."""
    generator = torch.Generator().manual_seed(0)
    graphs = []
    for tokens in (37, 64, 101):
        inputs = _inputs(op, tokens, generator)
        expected, expected_grads = _run(fused.REFERENCE[op], inputs)
        got, got_grads = _run(fused.kernel(op, "compile"), inputs)
        for a, b in zip(expected + expected_grads, got + got_grads, strict=True):
            torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-5)
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[-1], f"{op}: recompiled for a new token count ({graphs})"
    assert fused.kernel(op, "compile")._torchdynamo_orig_callable is fused.REFERENCE[op]  # compiled, not eager
    assert graphs[0] >= 1 and not dynamo_utils.counters["graph_break"]  # captured whole


def test_the_reference_rope_is_megatron_cores():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
    from megatron.core.transformer import TransformerConfig

    generator = torch.Generator().manual_seed(1)
    query, key, cos, _ = _inputs("rope", 9, generator)
    freqs = torch.acos(cos).detach()  # angles in [0, pi]: the same cos, and sin = sqrt(1 - cos^2) >= 0
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    expected = apply_rotary_pos_emb(query, freqs, config)
    torch.testing.assert_close(fused.reference_rope(query, key, torch.cos(freqs), torch.sin(freqs))[0], expected, rtol=0, atol=1e-6)


def test_a_layer_stack_with_compiled_kernels_builds_them_and_trains_as_the_unfused_one():
    """The profiler's LayerStack builds the fused layer through the spec the run trains with: its modules are the fused
    ones (undo the wiring and this goes red), its weights the unfused stack's, its loss and input gradient the same to
    fp32 rounding over three chunk shapes (a split slice among them), one graph per op for all of them."""
    from megatron_epp.measure.layer_bench import init_single_process
    from megatron_epp.measure.profiling import LayerStack

    init_single_process()
    choice = fused.FusedChoice("compile", "compile", "compile", "compile")
    plain, fast = LayerStack(SHAPE, 1, seed=0), LayerStack(SHAPE, 1, seed=0, fused_kernels=choice)
    kinds = {type(m).__name__ for m in fast.modules()}
    assert {"FusedRMSNorm", "FusedSwiGLUMLP"} <= kinds and not {"FusedRMSNorm", "FusedSwiGLUMLP"} & {type(m).__name__ for m in plain.modules()}
    assert fast.layers[0].self_attention.rope_backend == "compile" and plain.layers[0].self_attention.rope_backend == "torch"
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), fast.parameters(), strict=True))
    graphs = []
    for lengths in ((30, 10), (47,), (12, 20, 9)):
        for stack in (plain, fast):
            stack.set_segments(lengths, [0] * len(lengths))
        x = torch.randn(sum(lengths), 1, SHAPE.hidden, requires_grad=True)
        y = x.detach().clone().requires_grad_()
        expected, got = plain.head_loss(plain(x)), fast.head_loss(fast(y))
        expected.backward(), got.backward()
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(y.grad, x.grad, rtol=1e-5, atol=1e-7)
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[-1]


# --- the libraries' adapters, against fakes of their documented semantics -----------------------------------------

def _fake_liger(calls: list) -> dict:
    def norm(x, w, eps, offset, casting_mode, in_place):
        calls.append(("norm", casting_mode, in_place))
        return fused.reference_norm(x, w, eps, offset)

    def swiglu(y, in_place):
        calls.append(("swiglu", in_place))
        half = y.shape[-1] // 2
        return torch.nn.functional.silu(y[..., :half]) * y[..., half:]  # gate: the first half

    def rope(q, k, cos, sin):  # (B, H, T, D), cos/sin (1, T, D); written in place, as liger does
        assert q.shape[2] == cos.shape[1] and cos.shape[0] == 1 and q.dim() == 4
        calls.append(("rope", tuple(q.shape)))
        for t in (q, k):
            first, second = t.chunk(2, dim=-1)
            t.copy_(t * cos[:, None] + torch.cat((-second, first), -1) * sin[:, None])
        return q, k

    def cross_entropy(x, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction):
        calls.append(("cross_entropy", reduction, x.dim()))
        return torch.nn.functional.cross_entropy(x.float(), target, reduction=reduction), None, None, None

    def module(**functions):
        return types.SimpleNamespace(**{name: types.SimpleNamespace(apply=f) for name, f in functions.items()})

    return {"rms_norm": module(LigerRMSNormFunction=norm), "swiglu": module(LigerFusedGateUpSiLUMulFunction=swiglu),
            "rope": module(LigerRopeFunction=rope), "cross_entropy": module(LigerCrossEntropyFunction=cross_entropy)}


def _fake_quack(calls: list) -> dict:
    def rmsnorm(x, weight, eps, weight_offset):
        calls.append("norm")
        return fused.reference_norm(x, weight, eps, weight_offset)

    def apply_rotary_emb(x, cos, sin, interleaved, inplace):  # x (b, s, heads, d), cos/sin (s, rotary_dim / 2)
        assert x.shape[1] == cos.shape[0] and not interleaved and not inplace
        calls.append("rope")
        half = cos.shape[-1]
        x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
        c, s = cos[:, None], sin[:, None]
        return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c, rest), dim=-1)

    def cross_entropy(x, target, reduction):
        calls.append("cross_entropy")
        return torch.nn.functional.cross_entropy(x.float(), target, reduction=reduction)

    return {"rmsnorm": rmsnorm, "apply_rotary_emb": apply_rotary_emb, "cross_entropy": cross_entropy}


def _full_rope_inputs(generator):
    angles = torch.rand(11, 1, 1, 8, generator=generator) * 11
    angles = torch.cat((angles, angles), dim=-1)
    randn = lambda *s: torch.randn(*s, generator=generator).requires_grad_()  # noqa: E731
    return randn(11, 2, 4, 16), randn(11, 2, 2, 16), torch.cos(angles), torch.sin(angles)


@pytest.mark.parametrize("name", fused.LIBRARIES)
def test_the_adapters_hand_the_libraries_their_layouts_and_equal_the_reference(name):
    calls: list = []
    lib = (fused.liger_library(**_fake_liger(calls), version="0.8.5") if name == "liger"
           else fused.quack_library(**_fake_quack(calls), version="0.6.5"))
    generator = torch.Generator().manual_seed(2)
    cases = {"norm": _inputs("norm", 13, generator), "swiglu": _inputs("swiglu", 13, generator),
             "rope": _full_rope_inputs(generator), "cross_entropy": _inputs("cross_entropy", 13, generator)}
    for op, inputs in cases.items():
        if lib.ops[op] is None:
            assert (name, op) == ("quack", "swiglu")
            continue
        before = [t.detach().clone() for t in inputs if isinstance(t, torch.Tensor)]
        expected, expected_grads = _run(fused.REFERENCE[op], inputs)
        got, got_grads = _run(lib.ops[op], inputs)
        for a, b in zip(expected + expected_grads, got + got_grads, strict=True):
            torch.testing.assert_close(b, a)
        assert all(torch.equal(a, t) for a, t in zip(before, [t for t in inputs if isinstance(t, torch.Tensor)]))  # inputs untouched
    if name == "liger":
        assert ("norm", "llama", False) in calls and ("swiglu", False) in calls and ("cross_entropy", "none", 2) in calls
        assert ("rope", (2, 4, 11, 16)) in calls  # (B, H, T, D)
    assert lib.unsupported("norm", "cpu", BF16, None, 1) == f"tensors on cpu, {name} runs on cuda"


def test_the_libraries_are_absent_here_and_say_why():
    for probe in (fused.probe_liger, fused.probe_quack):
        found, why = probe()
        assert found is None and "does not import" in why
    with pytest.raises(fused.FusedKernelError, match="norm=liger"):
        fused.kernel("norm", "liger")


def test_the_fused_loss_model_computes_megatron_cores_per_token_loss():
    from megatron.core import tensor_parallel
    from megatron_epp.measure.layer_bench import init_single_process

    init_single_process()
    generator = torch.Generator().manual_seed(3)
    logits, labels = torch.randn(9, 2, 128, generator=generator), torch.randint(0, 128, (2, 9), generator=generator)
    one_rank = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    model = types.SimpleNamespace(pg_collection=one_rank, _cross_entropy=fused.kernel("cross_entropy", "compile"))
    got = fused_layers.FusedLossGPTModel.compute_language_model_loss(model, labels, logits)
    expected = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous()).transpose(0, 1)
    assert got.shape == (2, 9)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)


def test_the_benchmark_runs_on_the_cpu_at_toy_sizes_and_ends_with_one_json_line(capsys):
    import json

    from benchmarks import fused_kernels

    toy = ["--device", "cpu", "--tokens", "48", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "96",
           "--vocab", "128", "--repeats", "1", "--ops", "swiglu,cross_entropy,linear_cross_entropy", "--candidates", "torch,compile,liger"]
    assert fused_kernels.main(toy) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {(r["op"], r["candidate"]): r for r in summary["results"]}
    assert summary["shape"]["tokens"] == 48 and len(rows) == 9
    assert rows["swiglu", "torch"]["max_abs_error"] == 0 and rows["swiglu", "compile"]["max_abs_error"] < 1e-5
    assert "does not import" in rows["swiglu", "liger"]["skipped"] and "skipped" in rows["linear_cross_entropy", "compile"]
    with pytest.raises(SystemExit):
        fused_kernels.main(["--device", "cpu", "--ops", "layernorm"])
