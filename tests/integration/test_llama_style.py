"""``examples/llama_style.sh``: a LLaMA-style launch in Megatron-LM's flag names (SwiGLU, RMSNorm,
grouped-query attention 8:2, no biases, RoPE base 500000) with ``--elastic-pp`` at pp 2 on the
standard library's sources trains 20 steps with falling loss, and the planner's activation memory
equals the measured one on every step. The flags reach megatron-core's config and layers on both
paths; bad combinations are one-line errors."""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.nn.functional as F
from megatron.core.utils import unwrap_model

from megatron_epp.executor.context import ChunkContext
from megatron_epp.measure.layer_bench import init_single_process
from megatron_epp.config.parser import parse_config
from megatron_epp.training.planning import online_planner
from megatron_epp.base.dims import ParallelDims
from megatron_epp.model.runtime import Runtime
from megatron_epp.training.metrics import read_metrics
from megatron_epp.model.gpt import build_model
from tests.launch import REPO, free_port, run_env


def test_llama_style_example_trains_with_falling_loss(tmp_path):
    """Under --profile (nsys's: on CPU nothing to capture, said at start-up) it trains as without."""
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run(
        ["bash", str(REPO / "examples/llama_style.sh"), "--epp-metrics", str(metrics), "--profile", "--profile-step-start",
         "4", "--profile-step-end", "6", "--profile-ranks", "0", "1"], cwd=tmp_path,
        env=run_env({"MASTER_PORT": str(free_port())}), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert ("> profile: iterations 4 to 5 on ranks 0, 1 are marked for nsys (cudaProfilerStart/Stop, NVTX ranges): on cpu "
            "there is nothing for nsys to capture, training runs unprofiled") in proc.stdout
    assert ("> architecture: SwiGLU MLP, RMSNorm (eps 1e-05), grouped-query attention 8:2, head dim 16, no biases, "
            "RoPE base 500000") in proc.stdout
    train = [m for m in read_metrics(metrics) if m.kind == "train"]
    assert [m.iteration for m in train] == list(range(1, 21))
    first, last = train[0].loss, sum(m.loss for m in train[-5:]) / 5
    assert last < 0.8 * first, f"loss {first} -> {last}"
    for m in train:  # the memory model counts SwiGLU, RMSNorm, GQA and no biases to the byte
        assert m.elastic.predicted_activation_bytes == m.elastic.measured_activation_bytes, m.iteration


LLAMA = ["--mock-data", "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "8", "--kv-channels", "16",
         "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size", "352",
         "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--disable-bias-linear", "--rotary-base", "500000"]


@pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "stock"])
def test_llama_flags_reach_the_model(elastic):
    """Every LLaMA-style flag lands in megatron-core's TransformerConfig and the built layers, on the
    elastic and the stock path: torch RMSNorm with the epsilon, QKV of 8 query and 2 K/V heads of 16,
    fc1 twice the FFN width (SwiGLU), no bias anywhere, RoPE frequencies of base 500000."""
    init_single_process()
    args = parse_config(LLAMA + (["--elastic-pp"] if elastic else []), world_size=1).replace(model={"vocab_size": 64})
    runtime = Runtime(torch.device("cpu"), rank=0, pp_rank=0, tp_rank=0, dp_rank=0, dims=ParallelDims())
    model, config = build_model(args, runtime, context=ChunkContext() if elastic else None)
    assert (config.gated_linear_unit, config.activation_func, config.normalization, config.layernorm_epsilon) == (True, F.silu, "RMSNorm", 1e-6)
    assert (config.num_query_groups, config.kv_channels, config.add_bias_linear) == (2, 16, False)
    assert parse_config(["--mock-data", "--hidden-size", "4096", "--num-attention-heads", "32", "--swiglu"], world_size=1).model.ffn_hidden_size == 10880
    gpt = unwrap_model(model)
    layer = gpt.decoder.layers[0]
    norms = [m for m in gpt.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 2 * 2 + 1 and all(m.eps == 1e-6 for m in norms)
    assert layer.self_attention.linear_qkv.weight.shape == ((8 + 2 * 2) * 16, 128)
    assert layer.self_attention.linear_proj.weight.shape == (128, 8 * 16)
    assert layer.mlp.linear_fc1.weight.shape == (2 * 352, 128)
    assert not [n for n, _ in gpt.named_parameters() if n.endswith("bias")]
    rotary = gpt.rotary_pos_emb.inner if elastic else gpt.rotary_pos_emb
    torch.testing.assert_close(rotary.inv_freq, 500000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    if elastic:  # the planner's shape (OnlinePlanner, from the same flags) counts the layer's parameters exactly
        shape = online_planner(args).cost_model.profile.model
        assert (shape.num_kv_heads, shape.kv_channels, shape.swiglu, shape.normalization, shape.bias) == (2, 16, True, "RMSNorm", False)
        assert shape.params_per_layer() == sum(p.numel() for p in layer.parameters())


def test_gpt_style_parameter_count():
    """The planner's per-layer parameter count with LayerNorm and biases, against megatron-core's layer."""
    init_single_process()
    args = parse_config(["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--elastic-pp"],
                        world_size=1).replace(model={"vocab_size": 64})
    runtime = Runtime(torch.device("cpu"), rank=0, pp_rank=0, tp_rank=0, dp_rank=0, dims=ParallelDims())
    model, _ = build_model(args, runtime, context=ChunkContext())
    shape = online_planner(args).cost_model.profile.model
    assert shape.params_per_layer() == sum(p.numel() for p in unwrap_model(model).decoder.layers[0].parameters())


@pytest.mark.parametrize("extra", [["--add-qkv-bias"], ["--qk-layernorm", "--kv-channels", "32"]], ids=["qwen2", "qwen3"])
def test_qwen_style_layers_and_parameter_count(extra):
    """--add-qkv-bias (Qwen2): biases on linear_qkv alone; --qk-layernorm (Qwen3): RMSNorms of the head dimension on
    the query and key; the planner's shape counts the layer's parameters exactly, and a stage's (rank_parameters)."""
    init_single_process()
    args = parse_config(LLAMA + extra + ["--elastic-pp"], world_size=1).replace(model={"vocab_size": 64})
    runtime = Runtime(torch.device("cpu"), rank=0, pp_rank=0, tp_rank=0, dp_rank=0, dims=ParallelDims())
    model, config = build_model(args, runtime, context=ChunkContext())
    gpt = unwrap_model(model)
    attention = gpt.decoder.layers[0].self_attention
    assert [n for n, _ in gpt.named_parameters() if n.endswith("bias")] == \
        ([f"decoder.layers.{i}.self_attention.linear_qkv.bias" for i in range(2)] if "--add-qkv-bias" in extra else [])
    if "--qk-layernorm" in extra:
        assert config.qk_layernorm and all(isinstance(n, torch.nn.RMSNorm) and n.weight.shape == (32,) and n.eps == 1e-6
                                           for n in (attention.q_layernorm, attention.k_layernorm))
    shape = online_planner(args).cost_model.profile.model
    assert (shape.qkv_bias, shape.qk_norm) == ("--add-qkv-bias" in extra, "--qk-layernorm" in extra)
    assert shape.params_per_layer() == sum(p.numel() for p in gpt.decoder.layers[0].parameters())
    assert shape.rank_parameters([2], 1)[0] == sum(p.numel() for p in gpt.parameters())


@pytest.mark.parametrize(
    "flags, world_size, message",
    [
        (["--num-query-groups", "2"], 1, "--num-query-groups needs --group-query-attention"),
        (["--group-query-attention"], 1, "--group-query-attention needs --num-query-groups N"),
        (["--group-query-attention", "--num-query-groups", "3"], 1, "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
        (["--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"], 2,
         "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2"),
        (["--normalization", "LayerNorm1P"], 1, "argument --normalization: invalid choice: 'LayerNorm1P'"),
        (["--norm-epsilon", "0"], 1, "--norm-epsilon 0.0: must be > 0"),
        (["--kv-channels", "7"], 1, "--kv-channels 7: RoPE needs an even head dimension"),
        (["--hidden-size", "30"], 1, "--hidden-size must be divisible by --num-attention-heads (or give --kv-channels)"),
        (["--swiglu", "--hidden-size", "16"], 1, "--swiglu with --hidden-size 16: give --ffn-hidden-size"),
        (["--position-embedding-type", "learned_absolute", "--rotary-base", "500000"], 1,
         "--rotary-base applies only with --position-embedding-type rope"),
    ],
)
def test_bad_llama_flags_give_one_line_error(pretrain_in_process, flags, world_size, message):
    proc = pretrain_in_process("--mock-data", "--num-layers", "4", *flags, world_size=world_size)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert proc.stdout == ""
