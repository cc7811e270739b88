"""Hugging Face LLaMA-family checkpoints (``config.json`` + ``*.safetensors``) and megatron-core's GPTModel, both ways.

The families (:data:`FAMILIES`): LLaMA, Mistral (without a sliding window: one line where it is set), Qwen2 and
Qwen2.5 (biases on Q, K and V only: ``--add-qkv-bias``), Qwen3 (a norm over each head's query and key:
``--qk-layernorm``), each through megatron-core's own options. :func:`read_spec` reads such a ``config.json``
(GQA, ``head_dim`` given or derived, tied or untied
embeddings, RoPE as ``rope_theta`` + ``rope_scaling`` or transformers 5's ``rope_parameters``, scaling ``llama3`` or
``linear``, the weights' dtype) into a :class:`LlamaSpec`; :func:`implied_flags` is the ``pretrain_gpt.py`` flag line of
that model.
:class:`ShardReader` opens the ``*.safetensors`` files (sharded with ``model.safetensors.index.json`` or one file)
with the ``safetensors`` package and checks every tensor's name and shape from the files' headers before anything
is read; :func:`megatron_tensor` then reads one rank's part of one megatron-core parameter, slice by slice
(``safe_open(...).get_slice``): no rank ever holds the whole model. :func:`hf_tensors` is the way back, from a full
(tensor-parallel-gathered) megatron-core parameter to its Hugging Face tensors.

Megatron-core's layout: ``linear_qkv`` holds, per K/V group, the group's query heads, then its key, then its value
head (its bias alike); ``linear_fc1`` is ``[gate; up]`` per tensor-parallel rank; the vocabulary is padded to a multiple of
``--make-vocab-size-divisible-by`` x tp (:func:`implied_flags` chooses that multiple so that nothing is padded: padded
rows would join the softmax and change the logits' normalisation). Hugging Face's q/k projections are already in
the "rotate half" order megatron-core's non-interleaved RoPE uses: no permutation.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class Family:
    """A Hugging Face model family this module converts: its ``architectures`` entry and what its attention has beyond
    LLaMA's: biases on the query, key and value projections only (``--add-qkv-bias``), a norm over each head's query
    and key (``--qk-layernorm``)."""

    architecture: str
    qkv_bias: bool = False
    qk_norm: bool = False


# ``model_type`` -> family. Mistral is LLaMA's layer (its sliding window refused where set, :func:`_sliding_window`).
FAMILIES = {
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family("MistralForCausalLM"),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
}

# Hugging Face's names for the dtype of the weights (config.json's ``dtype``, or ``torch_dtype`` before transformers 5)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the pretrain_gpt.py flag of each 16-bit dtype
PRECISION_FLAGS = {"bfloat16": "--bf16", "float16": "--fp16"}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFCheckpointError(ValueError):
    """A Hugging Face directory that cannot be imported, or a checkpoint that cannot be exported: one line."""


@dataclass(frozen=True)
class LlamaSpec:
    """A LLaMA-family model's shape and RoPE (LLaMA, Mistral, Qwen2, Qwen3: :data:`FAMILIES`), as a Hugging Face
    ``config.json`` and ``pretrain_gpt.py``'s flags say it."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    norm_epsilon: float
    rope_theta: float
    tied: bool
    max_positions: int
    rope: dict[str, Any]  # {"rope_type": "default" | "llama3" | "linear", and that type's parameters}
    model_type: str = "llama"  # a key of FAMILIES
    dtype: str = "float32"  # the weights' dtype (a key of DTYPES): what the import trains in, what the export writes

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face tensor of this model and its shape."""
        h, q, kv, f = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.ffn_hidden_size
        out = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tied:
            out["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out.update({
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q), p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f), p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            })
            if self.family.qkv_bias:
                out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)})
            if self.family.qk_norm:
                out.update({p + "self_attn.q_norm.weight": (self.head_dim,), p + "self_attn.k_norm.weight": (self.head_dim,)})
        return out


def _rope(config: dict[str, Any], where: str) -> tuple[float, dict[str, Any]]:
    """RoPE's base and scaling from either form: ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))  # transformers' default
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise HFCheckpointError(f"{where}: unsupported rope_scaling type {kind!r} (megatron-epp imports {', '.join(ROPE_TYPES)})")
    rope: dict[str, Any] = {"rope_type": kind}
    needed = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "linear": ("factor",), "default": ()}[kind]
    for key in needed:
        if key not in params:
            raise HFCheckpointError(f"{where}: rope_scaling of type {kind} without its {key}")
        rope[key] = params[key]
    return float(params["rope_theta"]), rope


def _sliding_window(config: dict[str, Any], where: str) -> None:
    """One line for a model whose attention is windowed somewhere: Mistral's ``sliding_window`` when set, Qwen's
    ``use_sliding_window``, any layer of ``layer_types`` other than ``full_attention``. The elastic attention is causal
    over the whole document (``--window-size`` is refused), so such a model would compute other logits."""
    window = config.get("sliding_window")
    if config.get("model_type") == "mistral" and window is not None:
        raise HFCheckpointError(f"{where}: sliding_window {window} is set: megatron-epp's attention is causal over the whole "
                                "document (no --window-size), so this model's logits would differ beyond that window")
    if config.get("use_sliding_window"):
        raise HFCheckpointError(f"{where}: use_sliding_window is true (sliding_window {window}): megatron-epp's attention is "
                                "causal over the whole document (no --window-size)")
    windowed = sorted({t for t in config.get("layer_types") or () if t != "full_attention"})
    if windowed:
        raise HFCheckpointError(f"{where}: layer_types has {windowed[0]!r} layers: megatron-epp's attention is causal over "
                                "the whole document in every layer (no --window-size)")


def _dtype(config: dict[str, Any], where: str) -> str:
    """The weights' dtype config.json states (``dtype``, or ``torch_dtype`` before transformers 5; float32 if none)."""
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise HFCheckpointError(f"{where}: dtype {dtype!r} is not supported ({', '.join(DTYPES)})")
    return dtype


def _check_family(config: dict[str, Any], hf_dir: str, where: str) -> str:
    """``config``'s model_type, one of :data:`FAMILIES` whose layer this module builds; one line otherwise."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise HFCheckpointError(f"{hf_dir}: model_type {model_type!r} (architectures {config.get('architectures')}) is not "
                                f"supported: megatron-epp imports {', '.join(FAMILIES)}")
    # LLaMA's and Qwen3's attention_bias puts biases on the output projection too; Qwen2's biases are fixed (Q, K, V)
    fixed = {"hidden_act": "silu", "mlp_bias": False} | ({} if model_type == "qwen2" else {"attention_bias": False})
    for key, want in fixed.items():
        if config.get(key) not in (None, want):
            raise HFCheckpointError(f"{where}: {key} {config[key]!r} is not supported (a {model_type} model that megatron-epp "
                                    f"imports has {want!r})")
    _sliding_window(config, where)
    return model_type


def read_spec(hf_dir: str) -> LlamaSpec:
    """The model ``hf_dir/config.json`` describes; :class:`HFCheckpointError` when it is none this can import."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise HFCheckpointError(f"{hf_dir}: not a Hugging Face checkpoint (no config.json)")
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError:
        raise HFCheckpointError(f"{path}: not valid JSON") from None
    where = path
    model_type = _check_family(config, hf_dir, where)
    try:
        heads = int(config["num_attention_heads"])
        theta, rope = _rope(config, where)
        return LlamaSpec(
            num_layers=int(config["num_hidden_layers"]), hidden_size=int(config["hidden_size"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            ffn_hidden_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
            norm_epsilon=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            tied=bool(config.get("tie_word_embeddings", False)), max_positions=int(config.get("max_position_embeddings", 2048)),
            rope=rope, model_type=model_type, dtype=_dtype(config, where),
        )
    except KeyError as missing:
        raise HFCheckpointError(f"{where}: no {missing.args[0]}") from None


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def vocab_multiple(vocab_size: int, tp: int) -> int:
    """``--make-vocab-size-divisible-by`` for this vocabulary at ``tp``: the largest power of two up to Megatron-LM's
    128 with which nothing is padded (padded rows would change the logits' softmax)."""
    if vocab_size % tp:
        raise HFCheckpointError(f"vocab_size {vocab_size} is not divisible by --tensor-model-parallel-size {tp}: megatron-core "
                                "would pad the output layer, and the padded logits would change the loss")
    multiple = 128
    while vocab_size % (multiple * tp):
        multiple //= 2
    return multiple


def implied_flags(spec: LlamaSpec, tp: int = 1) -> list[str]:
    """``pretrain_gpt.py``'s flags for this model (its shape, norm, attention biases and norms, RoPE and scaling,
    vocabulary, embeddings, and ``--bf16`` / ``--fp16`` for weights stored in that dtype)."""
    flags = ["--num-layers", str(spec.num_layers), "--hidden-size", str(spec.hidden_size),
             "--num-attention-heads", str(spec.num_heads)]
    if spec.num_kv_heads != spec.num_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(spec.num_kv_heads)]
    flags += ["--kv-channels", str(spec.head_dim), "--ffn-hidden-size", str(spec.ffn_hidden_size), "--swiglu",
              "--normalization", "RMSNorm", "--norm-epsilon", repr(spec.norm_epsilon), "--disable-bias-linear",
              "--position-embedding-type", "rope", "--rotary-base", str(rotary_base(spec.rope_theta)),
              "--vocab-size", str(spec.vocab_size), "--make-vocab-size-divisible-by", str(vocab_multiple(spec.vocab_size, tp)),
              "--seq-length", str(spec.max_positions)]
    if spec.family.qkv_bias:
        flags.append("--add-qkv-bias")
    if spec.family.qk_norm:
        flags.append("--qk-layernorm")
    if spec.dtype in PRECISION_FLAGS:
        flags.append(PRECISION_FLAGS[spec.dtype])
    if not spec.tied:
        flags.append("--untie-embeddings-and-output-weights")
    if spec.rope["rope_type"] == "llama3":
        flags += ["--use-rope-scaling", "--rope-scaling-factor", _number(spec.rope["factor"]),
                  "--rope-scaling-low-freq-factor", _number(spec.rope["low_freq_factor"]),
                  "--rope-scaling-high-freq-factor", _number(spec.rope["high_freq_factor"]),
                  "--rope-scaling-original-max-position-embeddings", str(int(spec.rope["original_max_position_embeddings"]))]
    elif spec.rope["rope_type"] == "linear":
        flags += ["--rotary-seq-len-interpolation-factor", _number(spec.rope["factor"])]
    return flags


def rotary_base(theta: float) -> int:
    """``--rotary-base`` is an integer (Megatron-LM's type)."""
    if not float(theta).is_integer():
        raise HFCheckpointError(f"config.json: rope_theta {theta} is not an integer (Megatron-LM's --rotary-base is)")
    return int(theta)


class ShardReader:
    """The ``*.safetensors`` files of ``hf_dir``, opened lazily; :meth:`check` compares every tensor with ``spec``
    from the headers alone."""

    def __init__(self, hf_dir: str) -> None:
        from safetensors import (
            safe_open,  # the import's and export's one dependency beyond torch
        )

        self._open = safe_open
        self.dir = hf_dir
        index = os.path.join(hf_dir, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.where = dict(json.load(f)["weight_map"])
        elif os.path.isfile(os.path.join(hf_dir, SINGLE)):
            self.where = None
        else:
            raise HFCheckpointError(f"{hf_dir}: no {SINGLE} nor {INDEX}")
        self._files: dict[str, Any] = {}

    def _file(self, name: str):
        if name not in self._files:
            path = os.path.join(self.dir, name)
            if not os.path.isfile(path):
                raise HFCheckpointError(f"{self.dir}: shard {name} is missing ({INDEX} names it)")
            self._files[name] = self._open(path, framework="pt")
        return self._files[name]

    def names(self) -> dict[str, str]:
        """Every tensor and the file that holds it."""
        if self.where is None:
            return {k: SINGLE for k in self._file(SINGLE).keys()}
        return self.where

    def check(self, spec: LlamaSpec) -> None:
        """Every tensor ``spec`` needs is there with its shape, and no other: one line for the first that is not."""
        found = self.names()
        for name in sorted(set(found.values())):
            self._file(name)  # a missing shard first
        expected = spec.expected_tensors()
        for name, shape in expected.items():
            if name not in found:
                raise HFCheckpointError(f"{self.dir}: tensor {name} is missing")
            got = tuple(self._file(found[name]).get_slice(name).get_shape())
            if got != shape:
                raise HFCheckpointError(f"{self.dir}: tensor {name} has shape {list(got)}, config.json implies {list(shape)}")
        extra = sorted(n for n in found if n not in expected and not n.endswith("rotary_emb.inv_freq"))
        if extra:
            raise HFCheckpointError(f"{self.dir}: tensor {extra[0]} is not part of a {spec.model_type} model of this config.json")

    def slice(self, name: str):
        """``safe_open(...).get_slice(name)``: index it to read that part only."""
        file = self.where[name] if self.where is not None else SINGLE
        return self._file(file).get_slice(name)


def _rows(reader: ShardReader, name: str, start: int, stop: int) -> torch.Tensor:
    return reader.slice(name)[start:stop]


def _cols(reader: ShardReader, name: str, start: int, stop: int) -> torch.Tensor:
    return reader.slice(name)[:, start:stop]


def megatron_tensor(reader: ShardReader, spec: LlamaSpec, name: str, layer: int | None, tp: int, tp_rank: int,
                    padded_vocab: int) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s part of megatron-core's parameter ``name`` (local to its stage; ``layer``:
    its global layer index), read from the Hugging Face tensors slice by slice."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        source = "lm_head.weight" if name == "output_layer.weight" and not spec.tied else "model.embed_tokens.weight"
        rows = padded_vocab // tp
        part = _rows(reader, source, tp_rank * rows, min((tp_rank + 1) * rows, spec.vocab_size))
        return torch.cat([part, part.new_zeros(rows - part.shape[0], part.shape[1])]) if part.shape[0] < rows else part
    if name == "decoder.final_layernorm.weight":
        return _rows(reader, "model.norm.weight", 0, spec.hidden_size)
    hf = f"model.layers.{layer}."
    local = name.split(".", 3)[3]  # decoder.layers.<i>.<local>
    d, f = spec.head_dim, spec.ffn_hidden_size
    if local == "input_layernorm.weight":
        return _rows(reader, hf + "input_layernorm.weight", 0, spec.hidden_size)
    if local == "pre_mlp_layernorm.weight":
        return _rows(reader, hf + "post_attention_layernorm.weight", 0, spec.hidden_size)
    if local in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):  # per K/V group: its Q heads, K, V
        kind = local.rsplit(".", 1)[1]
        groups, per_group = spec.num_kv_heads // tp, spec.num_heads // spec.num_kv_heads
        parts = []
        for g in range(tp_rank * groups, (tp_rank + 1) * groups):
            parts += [_rows(reader, hf + f"self_attn.q_proj.{kind}", g * per_group * d, (g + 1) * per_group * d),
                      _rows(reader, hf + f"self_attn.k_proj.{kind}", g * d, (g + 1) * d),
                      _rows(reader, hf + f"self_attn.v_proj.{kind}", g * d, (g + 1) * d)]
        return torch.cat(parts)
    if local in QK_NORMS:  # whole on every tensor-parallel rank
        return _rows(reader, hf + QK_NORMS[local], 0, d)
    if local == "self_attention.linear_proj.weight":
        width = spec.num_heads * d // tp
        return _cols(reader, hf + "self_attn.o_proj.weight", tp_rank * width, (tp_rank + 1) * width)
    if local == "mlp.linear_fc1.weight":
        width = f // tp
        return torch.cat([_rows(reader, hf + f"mlp.{p}_proj.weight", tp_rank * width, (tp_rank + 1) * width) for p in ("gate", "up")])
    if local == "mlp.linear_fc2.weight":
        width = f // tp
        return _cols(reader, hf + "mlp.down_proj.weight", tp_rank * width, (tp_rank + 1) * width)
    raise HFCheckpointError(f"megatron-core parameter {name} has no Hugging Face {spec.model_type} counterpart")


# megatron-core's query and key norms (--qk-layernorm) and Qwen3's
QK_NORMS = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight", "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}


def gather_order(name: str, full: torch.Tensor, tp: int) -> torch.Tensor:
    """A parameter gathered over the tensor-parallel ranks along its partition dimension, in the unsharded order:
    a SwiGLU ``linear_fc1`` gathers as ``[gate_0; up_0; gate_1; up_1 ...]``, reordered here to ``[gate; up]``."""
    if name.endswith("mlp.linear_fc1.weight") and tp > 1:
        shards = [s.chunk(2, 0) for s in full.chunk(tp, 0)]
        return torch.cat([s[0] for s in shards] + [s[1] for s in shards])
    return full


def hf_tensors(spec: LlamaSpec, name: str, layer: int | None, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of megatron-core's whole (gathered) parameter ``name``; ``layer``: its global index."""
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": full[: spec.vocab_size]}
    if name == "output_layer.weight":
        return {} if spec.tied else {"lm_head.weight": full[: spec.vocab_size]}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": full}
    hf = f"model.layers.{layer}."
    local = name.split(".", 3)[3]
    if local == "input_layernorm.weight":
        return {hf + "input_layernorm.weight": full}
    if local == "pre_mlp_layernorm.weight":
        return {hf + "post_attention_layernorm.weight": full}
    if local in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind, d, per_group = local.rsplit(".", 1)[1], spec.head_dim, spec.num_heads // spec.num_kv_heads
        row = full.shape[1:]  # (hidden,) for the weight, () for the bias
        q, k, v = full.reshape(spec.num_kv_heads, (per_group + 2) * d, *row).split([per_group * d, d, d], dim=1)
        return {hf + f"self_attn.{name}_proj.{kind}": part.reshape(-1, *row) for name, part in zip("qkv", (q, k, v))}
    if local in QK_NORMS:
        return {hf + QK_NORMS[local]: full}
    if local == "self_attention.linear_proj.weight":
        return {hf + "self_attn.o_proj.weight": full}
    if local == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2, 0)
        return {hf + "mlp.gate_proj.weight": gate, hf + "mlp.up_proj.weight": up}
    if local == "mlp.linear_fc2.weight":
        return {hf + "mlp.down_proj.weight": full}
    raise HFCheckpointError(f"megatron-core parameter {name} has no Hugging Face {spec.model_type} counterpart")


def hf_config(spec: LlamaSpec) -> dict[str, Any]:
    """``config.json`` of ``spec`` in its family's form (transformers 5's ``rope_parameters``; no sliding window)."""
    rope = {"rope_theta": spec.rope_theta, **spec.rope}
    config = {
        "architectures": [spec.family.architecture], "model_type": spec.model_type, "hidden_act": "silu",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size, "rms_norm_eps": spec.norm_epsilon, "max_position_embeddings": spec.max_positions,
        "rope_parameters": rope, "tie_word_embeddings": spec.tied, "dtype": spec.dtype,
    }
    if spec.model_type in ("llama", "qwen3"):
        config |= {"attention_bias": False} | ({"mlp_bias": False} if spec.model_type == "llama" else {})
    if spec.model_type == "mistral":
        config["sliding_window"] = None
    if spec.model_type.startswith("qwen"):
        config |= {"use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * spec.num_layers}
    return config


def record_family(model: dict[str, Any], model_type: str | None = None) -> str:
    """The family of a checkpoint's model record: Qwen3 with query and key norms, Qwen2 with QKV biases, else LLaMA
    (or ``model_type`` where given: ``mistral`` names LLaMA's layer as Mistral); one line for a ``model_type`` that
    does not fit the record."""
    found = "qwen3" if model.get("qk_layernorm") else "qwen2" if model.get("add_qkv_bias") else None
    if model.get("qk_layernorm") and model.get("add_qkv_bias"):
        raise HFCheckpointError("the checkpoint has both --add-qkv-bias and --qk-layernorm: no Hugging Face family this exports has both")
    if model_type is None:
        return found or "llama"
    if model_type not in FAMILIES:
        raise HFCheckpointError(f"--model-type {model_type}: not one of {', '.join(FAMILIES)}")
    if found != (model_type if model_type.startswith("qwen") else None):
        flag = {"qwen2": "--add-qkv-bias", "qwen3": "--qk-layernorm"}
        raise HFCheckpointError(f"--model-type {model_type}: a {model_type} model has {flag.get(model_type, 'neither --add-qkv-bias nor --qk-layernorm')}, "
                                f"the checkpoint's model has {flag.get(found, 'neither')}")
    return model_type


def spec_from_record(model: dict[str, Any], model_type: str | None = None, dtype: str = "float32") -> LlamaSpec:
    """The LLaMA-family model a megatron-epp checkpoint holds, from its ``epp_metadata.json`` model record
    (``pretrain_gpt.py``'s flags), as ``model_type`` (default :func:`record_family`'s) with weights in ``dtype``;
    :class:`HFCheckpointError` for a model that is none (GELU, LayerNorm, biases, learned positions)."""
    for key, want in (("swiglu", True), ("normalization", "RMSNorm"), ("disable_bias_linear", True), ("position_embedding_type", "rope"),
                      ("apply_layernorm_1p", False), ("rotary_percent", 1.0)):
        if model.get(key, want) != want:
            raise HFCheckpointError(f"the checkpoint's --{key.replace('_', '-')} is {model.get(key)!r}: a Hugging Face LLaMA-family model needs {want!r}")
    heads = model["num_attention_heads"]
    if model.get("use_rope_scaling"):
        rope = {"rope_type": "llama3", "factor": model["rope_scaling_factor"], "low_freq_factor": model["rope_scaling_low_freq_factor"],
                "high_freq_factor": model["rope_scaling_high_freq_factor"],
                "original_max_position_embeddings": model["rope_scaling_original_max_position_embeddings"]}
    elif model.get("rotary_seq_len_interpolation_factor"):
        rope = {"rope_type": "linear", "factor": model["rotary_seq_len_interpolation_factor"]}
    else:
        rope = {"rope_type": "default"}
    return LlamaSpec(
        num_layers=model["num_layers"], hidden_size=model["hidden_size"], num_heads=heads,
        num_kv_heads=model["num_query_groups"] if model.get("group_query_attention") else heads,
        head_dim=model.get("kv_channels") or model["hidden_size"] // heads, ffn_hidden_size=model["ffn_hidden_size"],
        vocab_size=model["vocab_size"], norm_epsilon=model["norm_epsilon"], rope_theta=float(model["rotary_base"]),
        tied=not model["untie_embeddings_and_output_weights"], max_positions=model["max_position_embeddings"], rope=rope,
        model_type=record_family(model, model_type), dtype=dtype,
    )


# What a checkpoint's model record holds that is no flag: derived from the flags (and the layout)
DERIVED_RECORD_KEYS = ("padded_vocab_size",)


def flags_from_record(model: dict[str, Any]) -> list[str]:
    """``pretrain_gpt.py``'s flags that give a checkpoint's model record (its values as flags; True: the switch)."""
    flags: list[str] = []
    for key, value in model.items():
        if key in DERIVED_RECORD_KEYS or value is None or value is False or (key == "num_query_groups" and not model.get("group_query_attention")):
            continue
        if key.startswith("rope_scaling_") and not model.get("use_rope_scaling"):  # recorded at their defaults: flags of the switch
            continue
        flags += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return flags + ["--seq-length", str(model["max_position_embeddings"])]
