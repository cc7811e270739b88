"""The checkpoint record's key lists (``checkpoint/records.py``) come from the fields' tags (``base/option_tags.py``),
not from lists that retype the names: each is pinned here as it was written out before (at e8fc223), in its order,
since ``epp_metadata.json`` writes the keys in that order and an older checkpoint must compare as it did."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_epp.base.option_tags import FINETUNE_FREE as FINETUNE_FREE_TAG, MODEL_SHAPE, ROPE_SCALING, SAMPLER
from megatron_epp.base.options import fields_tagged, option, tag_values
from megatron_epp.checkpoint import records
from megatron_epp.checkpoint.records import in_record_order
from megatron_epp.config.fields import DataConfig, ModelConfig, TrainingConfig

# the lists as records.py spelled them out at e8fc223
ROPE_ARGS = ("use_rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
             "rope_scaling_original_max_position_embeddings", "rotary_seq_len_interpolation_factor")
FINETUNE_FREE = ("max_position_embeddings", "rotary_base", *ROPE_ARGS)
MODEL_SHAPE_ARGS = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
    "position_embedding_type", "vocab_size", "untie_embeddings_and_output_weights", "swiglu", "normalization",
    "group_query_attention", "num_query_groups", "kv_channels", "disable_bias_linear", "rotary_base", "make_vocab_size_divisible_by",
    "norm_epsilon", "apply_layernorm_1p", "rotary_percent", *ROPE_ARGS,
    "add_qkv_bias", "qk_layernorm",  # appended on 2026-11-29 (Qwen2, Qwen3): a record without them is not compared on them
)
SAMPLER_ARGS = ("split", "seed", "seq_length", "global_batch_size")
PADDING_ARGS = ("make_vocab_size_divisible_by", "padded_vocab_size")


def test_the_derived_lists_are_the_lists_as_they_were_in_order():
    """Each list made from the tags equals the literal it replaced, in order (tuples: the order is compared)."""
    assert records.MODEL_SHAPE_ARGS == MODEL_SHAPE_ARGS
    assert records.ROPE_ARGS == ROPE_ARGS
    assert records.FINETUNE_FREE == FINETUNE_FREE
    assert records.SAMPLER_ARGS == SAMPLER_ARGS
    assert records.PADDING_ARGS == PADDING_ARGS


def test_the_records_write_the_keys_in_the_pinned_order():
    """``epp_metadata.json``'s ``model`` and ``data`` records: their keys, in the order json writes them."""
    cfg = TrainingConfig().replace(model={"ffn_hidden_size": 256, "max_position_embeddings": 128, "vocab_size": 64,
                                          "rotary_base": 10000})
    assert tuple(records.data_record(cfg)) == ("blend", *SAMPLER_ARGS)
    model_record = {k: getattr(cfg.model, k) for k in records.MODEL_SHAPE_ARGS}
    assert tuple(model_record) == MODEL_SHAPE_ARGS


@dataclass(frozen=True)
class UntaggedSwiglu(ModelConfig):
    """The planted fault: ``--swiglu`` declared without its model-shape tag (a subclass's field keeps its place)."""

    swiglu: bool = option("--swiglu", default=False, action="store_true", help="SwiGLU MLP, its tag forgotten")


@dataclass(frozen=True)
class SplitLast(DataConfig):
    """The planted fault: ``--split`` at the sampler record's last place instead of its first."""

    split: str = option("--split", tags={SAMPLER: 9}, default="969,30,1", help="train,valid,test weights")


@dataclass(frozen=True)
class SplitLastConfig(TrainingConfig):
    data: SplitLast = field(default_factory=SplitLast)


def test_a_forgotten_tag_or_another_place_changes_the_derived_list():
    """A field that loses its tag drops out of the derived list, and a field at another place moves in it: either
    turns :func:`test_the_derived_lists_are_the_lists_as_they_were_in_order` red."""
    assert in_record_order(ModelConfig, MODEL_SHAPE) == MODEL_SHAPE_ARGS
    planted = in_record_order(UntaggedSwiglu, MODEL_SHAPE)
    assert "swiglu" not in planted and planted == tuple(k for k in MODEL_SHAPE_ARGS if k != "swiglu")
    assert fields_tagged(UntaggedSwiglu, ROPE_SCALING) == ROPE_ARGS  # the other tags as before
    assert fields_tagged(UntaggedSwiglu, FINETUNE_FREE_TAG) == FINETUNE_FREE
    assert in_record_order(TrainingConfig, SAMPLER) == SAMPLER_ARGS
    assert in_record_order(SplitLastConfig, SAMPLER) == ("seed", "seq_length", "global_batch_size", "split")


def test_every_place_is_taken_once():
    """A record's places are 0 .. n-1, each once: a new key takes the next place (appended to the record)."""
    assert sorted(tag_values(ModelConfig, MODEL_SHAPE).values()) == list(range(len(MODEL_SHAPE_ARGS)))
    assert sorted(tag_values(TrainingConfig, SAMPLER).values()) == list(range(len(SAMPLER_ARGS)))
