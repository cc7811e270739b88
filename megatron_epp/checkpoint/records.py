"""What a checkpoint records beside its shards, in Megatron-LM's directory layout: ``SAVE/iter_0000010/`` and the
tracker ``SAVE/latest_checkpointed_iteration.txt`` that names it, and ``epp_metadata.json``: the model shape and the
parallel layout it was saved with, the data stream it was trained on (the ``--data-path`` blend and the sampler's
settings and position), and (:mod:`.store`) the size and SHA-256 of every other file and its own checksum.
:func:`data_change` words, as a warning, a resume on another data stream (Megatron-LM allows it)."""

from __future__ import annotations

import json
import os
from typing import Any

from megatron_epp.base.option_tags import FINETUNE_FREE as FINETUNE_FREE_TAG, MODEL_SHAPE, ROPE_SCALING, SAMPLER, VOCAB_PADDING
from megatron_epp.base.options import fields_tagged, tag_values
from megatron_epp.config.fields import ModelConfig, TrainingConfig
from megatron_epp.data.blend import Blend
from megatron_epp.model.gpt import padded_vocab_size, params_dtype

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "epp_metadata.json"
FORMAT = "megatron-epp checkpoint 2"  # epp_metadata.json records every file's size and SHA-256


def in_record_order(cls: type, tag: str) -> tuple[str, ...]:
    """The keys of ``cls``'s fields tagged ``tag`` in the order a record writes them: by each one's place (the tag's value)."""
    places = tag_values(cls, tag)
    return tuple(sorted(places, key=places.__getitem__))


# The record's keys come from the fields' tags (base.option_tags); tests/unit/test_checkpoint_records.py pins them as
# they were before, in order: epp_metadata.json is written as it was, and older checkpoints compare as they did.

# RoPE's scaling: compared on a resume; with --finetune (context extension) the run may change them and RoPE's base
ROPE_ARGS = fields_tagged(ModelConfig, ROPE_SCALING)

# What --finetune (the model's weights only) may change besides the layout (any layout loads: Reshard): the context (with RoPE),
# RoPE's base and scaling (a context extension)
FINETUNE_FREE = fields_tagged(ModelConfig, FINETUNE_FREE_TAG)

# What a checkpoint must agree on with the run that loads it (a flag this version lacks reads as None on both sides), in
# the record's order
MODEL_SHAPE_ARGS = in_record_order(ModelConfig, MODEL_SHAPE)

# What the sample stream is a function of, besides the blend and its position (the consumed samples), in the record's order
SAMPLER_ARGS = in_record_order(TrainingConfig, SAMPLER)

# --use-distributed-optimizer: megatron-core's dp_reshardable format (each rank's flat shard as it is: no gather at save,
# reshards over the data- and context-parallel sizes only, DP x CP being the group it shards over) or, --dist-ckpt-optim-fully-reshardable, its fully_reshardable one (gathered
# over the data-parallel ranks into model space at save: loads at any layout); not its default flat-range format, which
# dist_checkpointing 0.16.1 no longer accepts ("ShardedTensor.flattened_range is not supported")
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
PLANNER_KEY = "epp_planner_state"

# The parallel sizes of the layout record: (its key, the ParallelDims field, the Runtime's rank of this rank in it), in the
# order of the per-rank objects' grid (RNG states, planner calibration). A checkpoint loads at any other sizes: megatron-core's
# dist_checkpointing reshards the model's and the optimizer's ShardedTensors.
LAYOUT_SIZES = (
    ("pipeline_model_parallel_size", "pp", "pp_rank"),
    ("tensor_model_parallel_size", "tp", "tp_rank"),
    ("data_parallel_size", "dp", "dp_rank"),
    ("context_parallel_size", "cp", "cp_rank"),
)

# sizes recorded (and in the grid) only where they are not 1: a checkpoint without context parallelism is as before it existed
OPTIONAL_SIZES = ("context_parallel_size",)

# the sizes whose change leaves every pipeline stage as saved: the dp_reshardable optimizer format and the planner's
# calibration (fitted to the stages' times and memory) carry over a change of these alone
REPLICA_SIZES = ("data_parallel_size",)

# the sizes the distributed optimizer shards its states over (megatron-core: the data-parallel group with context
# parallelism, DP x CP): its dp_reshardable format carries over a change of these alone
OPTIMIZER_REPLICA_SIZES = ("data_parallel_size", "context_parallel_size")

# model-shape flags compared through the padded vocabulary size they give at each layout's tensor-parallel size
PADDING_ARGS = (*fields_tagged(ModelConfig, VOCAB_PADDING), "padded_vocab_size")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def data_record(cfg: TrainingConfig) -> dict[str, Any]:
    """The data stream a run trains on: the ``--data-path`` blend (prefixes, normalised weights; None for
    ``--mock-data``) and the sampler's settings (its position is the checkpoint's consumed samples)."""
    blend, values = cfg.data.data_blend, cfg.values()
    return {
        "blend": None if blend is None else {"prefixes": list(blend.prefixes), "weights": blend.weights and list(blend.weights)},
        **{key: getattr(values, key) for key in SAMPLER_ARGS},
    }


def checkpoint_metadata(cfg: TrainingConfig, iteration: int, consumed_samples: int | None = None,
                        origin: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record saved beside the shards and compared on ``--load`` (:func:`save_checkpoint` adds the files'
    sizes and checksums, and the record's own); ``origin``: as :func:`inherited_origin` where None."""
    return {
        "format": FORMAT,
        "iteration": iteration,
        "model": {**{k: getattr(cfg.model, k) for k in MODEL_SHAPE_ARGS}, "padded_vocab_size": padded_vocab_size(cfg)},
        "layout": layout_record(cfg),
        "data": data_record(cfg),
        "consumed_samples": consumed_samples,
        "params_dtype": str(params_dtype(cfg)).removeprefix("torch."),  # the precision trained in: what an export writes
        "tokenizer": tokenizer_record(cfg),
        "hf_origin": origin if origin is not None else inherited_origin(cfg),
    }


def inherited_origin(cfg: TrainingConfig) -> dict[str, Any] | None:
    """The Hugging Face model a run's weights came from (``{"model_type": ...}``, written by ``hf_convert import``),
    as the ``--load`` checkpoint records it: carried from save to save, so an export names the family imported (a
    Mistral stays a Mistral though its layer is LLaMA's). None for a run that loads nothing or a model trained here."""
    if not cfg.checkpoint.load:
        return None
    try:
        with open(os.path.join(cfg.checkpoint.load, TRACKER)) as f:
            meta = read_metadata(iteration_dir(cfg.checkpoint.load, int(f.read().strip())))
    except (OSError, ValueError):
        return None
    return meta.get("hf_origin") if isinstance(meta, dict) else None


def tokenizer_record(cfg: TrainingConfig) -> dict[str, Any]:
    """The run's tokenizer: ``--tokenizer-type``, and ``--tokenizer-model`` as an absolute path (the files an export to
    Hugging Face copies beside the model; None where the type reads no such file)."""
    model = cfg.data.tokenizer_model
    return {"type": cfg.data.tokenizer_type, "model": model and os.path.abspath(model)}


def layout_record(cfg: TrainingConfig) -> dict[str, Any]:
    """The parallel layout a checkpoint is saved with: the sizes of :data:`LAYOUT_SIZES`, the optimizer and its
    format (``distrib_optim_sharding_type``: None for the plain optimizer)."""
    sharding = (FULLY_RESHARDABLE if cfg.checkpoint.dist_ckpt_optim_fully_reshardable else DP_RESHARDABLE) \
        if cfg.parallel.use_distributed_optimizer else None
    return {**{key: getattr(cfg.parallel.dims, dims) for key, dims, _ in LAYOUT_SIZES
               if key not in OPTIONAL_SIZES or getattr(cfg.parallel.dims, dims) != 1},
            "use_distributed_optimizer": cfg.parallel.use_distributed_optimizer, "distrib_optim_sharding_type": sharding}


class CheckpointError(RuntimeError):
    """A ``--load`` checkpoint that cannot be trusted (one line, naming the file): main prints it and exits."""


def read_metadata(path: str) -> Any:
    try:
        with open(os.path.join(path, METADATA)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _describe_blend(blend: dict[str, Any] | None) -> str:
    if blend is None:
        return "--mock-data"
    return Blend(tuple(blend["prefixes"]), blend["weights"] and tuple(blend["weights"])).describe()


def data_change(cfg: TrainingConfig, iteration: int) -> str | None:
    """One warning line when this run's data stream differs from the one ``--load``'s ``iteration`` (as
    :func:`check_loadable` found it) was trained on: another ``--data-path`` blend (prefixes or weights) or
    sampler setting. None when they agree (or the checkpoint predates the record).

    Not an error: Megatron-LM compares only the model and the parallel layout on load and rebuilds the blend
    from the new flags at the checkpoint's consumed samples, which is how a job anneals on another mixture.
    The stream then goes on from that position of the new blend's stream: what was drawn before is not
    tracked per dataset, so some documents may come again and others never."""
    meta = read_metadata(iteration_dir(cfg.checkpoint.load, iteration))
    saved = meta.get("data") if isinstance(meta, dict) else None
    if saved is None:
        return None
    now = data_record(cfg)
    changes = [f"--data-path {_describe_blend(saved['blend'])} -> {_describe_blend(now['blend'])}"] if saved["blend"] != now["blend"] else []
    changes += [f"--{k.replace('_', '-')} {saved[k]} -> {now[k]}" for k in SAMPLER_ARGS if saved.get(k) != now[k]]
    if not changes:
        return None
    return (f"warning: --load {cfg.checkpoint.load}: iteration {iteration} was trained on other data ({'; '.join(changes)}); "
            f"training goes on at sample {meta['consumed_samples']} of this run's stream, as in Megatron-LM: samples "
            "drawn before are not replayed or skipped by dataset, so some documents may repeat and others never come")
