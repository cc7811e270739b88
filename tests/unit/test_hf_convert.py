"""``hf_convert``'s bad input, one line each before any work (from config.json and the safetensors headers alone), the
flag line a Hugging Face LLaMA, Mistral, Qwen2 or Qwen3 implies, the family an export names, and a launch whose flags disagree with an imported checkpoint refused in one
line naming the first difference (``--finetune`` may change the context and RoPE, not the model's shape)."""

from __future__ import annotations

import json
import os
import shlex

import pytest
import torch
from safetensors.torch import save_file

from megatron_epp.checkpoint import integrity, records
from megatron_epp.config.parser import parse_config
from megatron_epp.config.errors import ArgumentError
from megatron_epp.checkpoint.hf_convert import main
from megatron_epp.checkpoint.hf_llama import implied_flags, read_spec

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 128, "tie_word_embeddings": True, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 32}}


def write(path, config=CONFIG, change=None, shards=2):
    """A Hugging Face LLaMA directory of zeros in ``shards`` files; ``change``: {tensor: shape} written instead."""
    os.makedirs(path, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    tensors = {k: torch.zeros(s) for k, s in read_spec(str(path)).expected_tensors().items()}
    tensors.update({k: torch.zeros(s) for k, s in (change or {}).items()})
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in names[i::shards]}, str(path / file))
        weight_map.update({k: file for k in names[i::shards]})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def error(capsys, *argv) -> str:
    assert main(["flags", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


def test_bad_input_one_line_each(tmp_path, capsys):
    assert "no config.json" in error(capsys, "--hf-dir", str(tmp_path))
    gpt2 = tmp_path / "gpt2"
    os.makedirs(gpt2)
    (gpt2 / "config.json").write_text(json.dumps({**CONFIG, "model_type": "gpt2"}))
    assert "model_type 'gpt2' (architectures ['LlamaForCausalLM']) is not supported: megatron-epp imports llama, mistral, qwen2, qwen3" \
        in error(capsys, "--hf-dir", str(gpt2))
    yarn = tmp_path / "yarn"
    os.makedirs(yarn)
    (yarn / "config.json").write_text(json.dumps({**CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    assert "unsupported rope_scaling type 'yarn' (megatron-epp imports default, llama3, linear)" in error(capsys, "--hf-dir", str(yarn))
    missing = write(tmp_path / "missing")
    os.remove(missing / "model-00002-of-00002.safetensors")
    assert "shard model-00002-of-00002.safetensors is missing" in error(capsys, "--hf-dir", str(missing))
    wrong = write(tmp_path / "wrong", change={"model.layers.1.self_attn.k_proj.weight": (32, 32)})
    assert error(capsys, "--hf-dir", str(wrong)).endswith(
        "tensor model.layers.1.self_attn.k_proj.weight has shape [32, 32], config.json implies [16, 32]")
    extra = write(tmp_path / "extra", change={"lm_head.weight": (64, 32)})  # tied, yet an output layer
    assert "tensor lm_head.weight is not part of a llama model of this config.json" in error(capsys, "--hf-dir", str(extra))
    odd = tmp_path / "odd"
    write(odd, {**CONFIG, "vocab_size": 63})
    assert "vocab_size 63 is not divisible by --tensor-model-parallel-size 2" in error(capsys, "--hf-dir", str(odd), "--tensor-model-parallel-size", "2")


def test_flag_line_and_disagreeing_launch(tmp_path, capsys):
    hf = write(tmp_path / "hf", {**CONFIG, "rope_scaling": None, "rope_parameters": {**CONFIG["rope_scaling"], "rope_theta": 500000.0}})
    assert main(["flags", "--hf-dir", str(hf)]) == 0
    line = capsys.readouterr().out.strip()
    assert line == ("pretrain_gpt.py --num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
                    "--kv-channels 8 --ffn-hidden-size 64 --swiglu --normalization RMSNorm --norm-epsilon 1e-06 --disable-bias-linear "
                    "--position-embedding-type rope --rotary-base 500000 --vocab-size 64 --make-vocab-size-divisible-by 64 "
                    "--seq-length 128 --use-rope-scaling --rope-scaling-factor 8 --rope-scaling-low-freq-factor 1 "
                    "--rope-scaling-high-freq-factor 4 --rope-scaling-original-max-position-embeddings 32")
    flags = shlex.split(line)[1:] + ["--mock-data"]
    saved = parse_config(flags, world_size=1)
    # with its tokenizer.json, the line names it for --tokenizer-type HuggingFaceTokenizer (LLaMA 3's end-of-text token: the EOD)
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(63)} | {"<|end_of_text|>": 63}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0")).save(str(hf / "tokenizer.json"))
    assert main(["flags", "--hf-dir", str(hf)]) == 0
    assert capsys.readouterr().out.strip() == f"{line} --tokenizer-type HuggingFaceTokenizer --tokenizer-model {hf}"
    with_tokenizer = parse_config(flags + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf)], world_size=1)
    assert (with_tokenizer.data.eod, with_tokenizer.model.vocab_size) == (63, 64)
    # a checkpoint's record as the import writes it (files: none, so only the record is compared)
    path = tmp_path / "ckpt" / "iter_0000000"
    os.makedirs(path)
    meta = {**records.checkpoint_metadata(saved, 0, 0), "files": {}}
    meta["sha256"] = integrity.record_sha256(meta)
    (path / records.METADATA).write_text(json.dumps(meta))
    (tmp_path / "ckpt" / records.TRACKER).write_text("0")
    load = ["--load", str(tmp_path / "ckpt"), "--finetune"]
    assert integrity.check_loadable(parse_config(flags + load, world_size=1)).candidates == [0]
    extended = flags + load + ["--seq-length", "512", "--rotary-base", "1000000", "--rope-scaling-factor", "16"]  # context extension
    assert integrity.check_loadable(parse_config(extended, world_size=1)).candidates == [0]
    for change, first in ((["--num-query-groups", "4"], "--num-query-groups 2, this run has 4"),
                          (["--norm-epsilon", "1e-5"], "--norm-epsilon 1e-06, this run has 1e-05"),
                          (["--untie-embeddings-and-output-weights"], "--untie-embeddings-and-output-weights False, this run has True")):
        with pytest.raises(ArgumentError, match=f"iteration 0 was saved with {first}"):
            integrity.check_loadable(parse_config(flags + load + change, world_size=1))
    with pytest.raises(ArgumentError, match="was saved with --rope-scaling-factor 8.0, this run has 16.0"):  # a resume compares RoPE too
        integrity.check_loadable(parse_config(flags + ["--load", str(tmp_path / "ckpt"), "--rope-scaling-factor", "16"], world_size=1))


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 6.0, "original_max_position_embeddings": 16},
    {"rope_type": "linear", "factor": 4.0}, {"rope_type": "default"}], ids=["llama3", "linear", "default"])
def test_rope_tables_are_transformers(tmp_path, rope):
    """The stock path's RoPE angles (megatron-core's ``get_emb``) and the elastic chunks' table (``RopeTable``) are
    ``transformers``' LLaMA rotary embedding, for each scaling with its own parameters; a scaling factor off is not."""
    transformers = pytest.importorskip("transformers")
    from megatron.core.utils import unwrap_model
    from megatron_epp.executor.context import ChunkContext
    from megatron_epp.base.dims import ParallelDims
    from megatron_epp.model.runtime import Runtime
    from megatron_epp.measure.layer_bench import init_single_process
    from megatron_epp.model.gpt import build_model

    config = {**CONFIG, "rope_scaling": None, "rope_parameters": {**rope, "rope_theta": 500000.0}, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    positions = 96
    hf = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures", "rope_scaling")})
    cos, sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf)(torch.zeros(1), torch.arange(positions)[None])
    init_single_process()
    runtime = Runtime(torch.device("cpu"), rank=0, pp_rank=0, tp_rank=0, dp_rank=0, dims=ParallelDims())
    flags = implied_flags(read_spec(str(tmp_path))) + ["--mock-data", "--seq-length", str(positions)]
    for elastic in (False, True):
        cfg = parse_config(flags + (["--elastic-pp"] if elastic else []), world_size=1)
        gpt = unwrap_model(build_model(cfg, runtime, context=ChunkContext() if elastic else None)[0])
        angles = (gpt.rotary_pos_emb.table.freqs if elastic else gpt.rotary_pos_emb.get_emb(positions))[:, 0, 0]
        torch.testing.assert_close(torch.cos(angles), cos[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.sin(angles), sin[0], rtol=1e-5, atol=1e-5)
    if rope["rope_type"] != "default":  # a factor off goes red
        key = "rope_scaling_factor" if rope["rope_type"] == "llama3" else "rotary_seq_len_interpolation_factor"
        off = cfg.replace(model={key: rope["factor"] * 1.25})
        angles = unwrap_model(build_model(off, runtime, context=ChunkContext())[0]).rotary_pos_emb.table.freqs[:, 0, 0]
        assert not torch.allclose(torch.sin(angles), sin[0], rtol=1e-5, atol=1e-5)


def _config_of(directory, config) -> str:
    os.makedirs(directory, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_families_flags_and_refusals(tmp_path, capsys):
    """Each family's flags (megatron-core's own options), its tensors, and what is refused in one line: a sliding window
    that is set, biases on the output projection, a dtype this cannot train."""
    base = {k: v for k, v in CONFIG.items() if k not in ("rope_scaling", "architectures")}
    qwen2 = write(tmp_path / "qwen2", {**base, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096,
                                       "dtype": "bfloat16"})
    assert main(["flags", "--hf-dir", str(qwen2)]) == 0
    line = capsys.readouterr().out
    assert "--add-qkv-bias" in line and "--qk-layernorm" not in line and "--bf16" in line
    assert {"model.layers.1.self_attn.q_proj.bias": (32,), "model.layers.1.self_attn.k_proj.bias": (16,)}.items() \
        <= read_spec(str(qwen2)).expected_tensors().items()
    qwen3 = write(tmp_path / "qwen3", {**base, "model_type": "qwen3", "head_dim": 16, "sliding_window": None})  # head_dim apart
    assert main(["flags", "--hf-dir", str(qwen3)]) == 0
    line = capsys.readouterr().out
    assert "--qk-layernorm" in line and "--kv-channels 16" in line and "--add-qkv-bias" not in line and "--bf16" not in line
    assert read_spec(str(qwen3)).expected_tensors()["model.layers.0.self_attn.q_norm.weight"] == (16,)
    mistral = write(tmp_path / "mistral", {**base, "model_type": "mistral", "sliding_window": None})
    assert main(["flags", "--hf-dir", str(mistral)]) == 0 and "--add-qkv-bias" not in capsys.readouterr().out
    for config, message in (
            ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window 4096 is set: megatron-epp's attention is causal"),
            ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64}, "use_sliding_window is true (sliding_window 64)"),
            ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "layer_types has 'sliding_attention' layers"),
            ({"model_type": "qwen3", "attention_bias": True}, "attention_bias True is not supported (a qwen3 model"),
            ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
            ({"model_type": "qwen2", "dtype": "float8_e4m3fn"}, "dtype 'float8_e4m3fn' is not supported")):
        assert message in error(capsys, "--hf-dir", _config_of(tmp_path / "bad", {**base, **config})), config


def test_export_family_of_a_record():
    """The family an export writes: from the model record, or ``--model-type`` where it fits; one line where not."""
    from megatron_epp.checkpoint.hf_llama import HFCheckpointError, record_family

    assert record_family({}) == "llama" and record_family({"add_qkv_bias": True}) == "qwen2"
    assert record_family({"qk_layernorm": True}) == "qwen3" and record_family({}, "mistral") == "mistral"
    with pytest.raises(HFCheckpointError, match="--model-type qwen2: a qwen2 model has --add-qkv-bias, the checkpoint's model has neither"):
        record_family({}, "qwen2")
    with pytest.raises(HFCheckpointError, match="--model-type llama: a llama model has neither .*, the checkpoint's model has --qk-layernorm"):
        record_family({"qk_layernorm": True}, "llama")
