"""Save/resume with megatron-core's dist_checkpointing, in Megatron-LM's directory layout.

``SAVE/iter_0000010/`` holds the sharded model and optimizer, the scheduler, the iteration, the
consumed samples, every rank's RNG state and (``--elastic-pp``) its planner's calibration, and
``epp_metadata.json`` (the model shape and the parallel layout it was saved with, and the data stream it
was trained on: the ``--data-path`` blend and the sampler's settings and position);
``SAVE/latest_checkpointed_iteration.txt`` names it.

A checkpoint is written to ``iter_0000010.tmp/`` and renamed once every rank has written its part,
the tracker file after it: a run that dies while saving leaves the previous checkpoint named and
whole. ``epp_metadata.json`` is written last (atomically, once every rank has written and hashed its files)
and records the size and SHA-256 of every other file of the checkpoint, and its own checksum.

Loading trusts nothing it has not verified. :func:`check_loadable` (before any process group exists, on
every rank: reads only ``epp_metadata.json`` and the files' sizes) refuses a foreign checkpoint (another
model shape, or a layout its optimizer states cannot reshard to: :class:`Reshard`) and picks the candidates: the tracker's iteration, then (unless ``--no-ckpt-fallback``)
the older ones; a candidate whose metadata is damaged or whose files are missing or of another size is
skipped with one warning line. :func:`choose_verified` (collective, after the process group exists) checks the
candidates' checksums, newest first, before megatron-core reads any file: each rank hashes the files its own
rank number wrote (``__R_*.distcp``, at another world size R modulo it; rank 0 the shared ones), the files a rank reads back on a load of the same
layout, so the whole checkpoint is read once, by all ranks in parallel (one rank hashing all of it would take
world-size times longer; every rank hashing all of it would read it world-size times). A damaged checkpoint is
one line naming the file, or with the fallback one warning line and the next older one. A checkpoint saved
before checksums were recorded (``megatron-epp checkpoint 1``) is refused in one line. :func:`data_change` words, as a
warning, a resume on another data stream (Megatron-LM allows it).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.distributed.checkpoint import FileSystemReader

from megatron_epp.data.blend import Blend
from megatron_epp.config.errors import ArgumentError
from megatron_epp.model.runtime import Runtime, set_seed
from megatron_epp.config.fields import TrainingConfig
from megatron_epp.model.gpt import pad_vocab, padded_vocab_size

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "epp_metadata.json"
FORMAT = "megatron-epp checkpoint 2"  # epp_metadata.json records every file's size and SHA-256
# RoPE's scaling: compared on a resume; with --finetune (context extension) the run may change them and RoPE's base
ROPE_ARGS = ("use_rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
             "rope_scaling_original_max_position_embeddings", "rotary_seq_len_interpolation_factor")
# What --finetune (the model's weights only) may change besides the layout (any layout loads: Reshard): the context (with RoPE),
# RoPE's base and scaling (a context extension)
FINETUNE_FREE = ("max_position_embeddings", "rotary_base", *ROPE_ARGS)
# What a checkpoint must agree on with the run that loads it (a flag this version lacks reads as None on both sides)
MODEL_SHAPE_ARGS = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
    "position_embedding_type", "vocab_size", "untie_embeddings_and_output_weights", "swiglu", "normalization",
    "group_query_attention", "num_query_groups", "kv_channels", "disable_bias_linear", "rotary_base", "make_vocab_size_divisible_by",
    "norm_epsilon", "apply_layernorm_1p", "rotary_percent", *ROPE_ARGS,
)
# What the sample stream is a function of, besides the blend and its position (the consumed samples)
SAMPLER_ARGS = ("split", "seed", "seq_length", "global_batch_size")
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
PADDING_ARGS = ("make_vocab_size_divisible_by", "padded_vocab_size")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rng_state() -> dict[str, Any]:
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(
    model, optimizer, scheduler, runtime: Runtime, iteration: int, consumed: int, is_loading: bool = False,
    planner_state: dict[str, Any] | None = None, sharding_type: str | None = None,
) -> dict[str, Any]:
    """What a checkpoint holds; ``is_loading`` makes the optimizer build its (still empty) state first. ``optimizer``
    None: the model, iteration, samples, RNG and planner parts only (a load without the optimizer: building its
    sharded state would create Adam states without their step). ``sharding_type``: the distributed optimizer's format."""
    model_state = model.module.sharded_state_dict()
    layout, here = _grid(runtime)
    optimizer_part = {} if optimizer is None else {
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=optimizer_metadata(sharding_type)),
        "scheduler": scheduler.state_dict(),
    }
    return {
        "model": model_state,
        **optimizer_part,
        "iteration": iteration,
        "consumed_samples": consumed,
        "rng": ShardedObject("rng_state", _rng_state(), layout, here, replica_id=0),
        # the elastic planner's online calibration (planner.online.OnlinePlanner.state_dict; None without --elastic-pp)
        "planner": ShardedObject(PLANNER_KEY, planner_state, layout, here, replica_id=0),
    }


def _grid(runtime: Runtime) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The per-rank objects' grid (the layout's sizes) and this rank's place in it, in :data:`LAYOUT_SIZES`' order."""
    sizes = [(dims, rank) for key, dims, rank in LAYOUT_SIZES if key not in OPTIONAL_SIZES or getattr(runtime.dims, dims) != 1]
    return tuple(getattr(runtime.dims, dims) for dims, _ in sizes), tuple(getattr(runtime, rank) for _, rank in sizes)


def optimizer_metadata(sharding_type: str | None) -> dict[str, Any]:
    """megatron-core's ``sharded_state_dict`` metadata for the distributed optimizer's ``sharding_type`` (ignored by the
    plain optimizer, whose states are saved per parameter in model space). ``fully_reshardable`` gathers the states
    over the data-parallel ranks with NCCL on CUDA (every rank then saves a part), over gloo to the first
    data-parallel rank on CPU (megatron-core's memory-efficient variant: its non-gloo gather is CUDA-only); the two
    load interchangeably."""
    return {"distrib_optim_sharding_type": sharding_type or DP_RESHARDABLE,
            "distrib_optim_fully_reshardable_mem_efficient": not torch.cuda.is_available()}


def _init_distributed_optimizer_states(optimizer) -> None:
    """Give a fresh ``DistributedOptimizer`` states to load into. Without Apex or Transformer Engine its
    ``state_dict`` reads the torch Adam's ``step`` of every parameter, which a freshly built optimizer has
    not got yet; megatron-core's own dummy initialisation (one zero-gradient step, as its FSDP path does
    before a load) creates them, and the load then overwrites states, main params and model params."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _restore_distributed_optimizer_steps(optimizer) -> None:
    """After a load, give every parameter's torch Adam state the checkpoint's ``step``, a tensor of its own.

    Without Apex or Transformer Engine, ``DistributedOptimizer.load_state_dict`` puts the checkpoint's
    step (saved in the param groups) into one tensor shared by all states (torch's Adam increments each
    parameter's in place: every step would advance it once per parameter), and the ``dp_reshardable``
    parameter state then overwrites it with the loading template's step (that of the dummy states).
    Either way the bias correction would differ from the uninterrupted run's."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer):
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    state = opt.optimizer.state.get(param)
                    if state:  # fully_reshardable: loaded without its step (_load_optimizer)
                        state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def _load_optimizer(optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``. megatron-core 0.16.1 without Apex or Transformer Engine cannot load the
    distributed optimizer's ``fully_reshardable`` states: it copies every torch Adam state of the parameter, its
    ``step`` included, from the checkpoint's, which has none (``KeyError: 'step'``); so the steps are taken out of
    the states just before (:func:`_restore_distributed_optimizer_steps` puts them back from the param groups)."""
    patched = [opt for opt in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(opt, DistributedOptimizer)]
    for opt in patched:
        def stepless(param_state, opt=opt, load=opt.load_parameter_state_from_fully_reshardable):
            for adam_state in opt.optimizer.state.values():
                adam_state.pop("step", None)
            load(param_state)
        opt.load_parameter_state_from_fully_reshardable = stepless  # this load only: the instance attribute is removed below
    try:
        with torch.no_grad():  # the distributed optimizer copies into its fp32 shards, views of the parameters
            optimizer.load_state_dict(state)
    finally:
        for opt in patched:
            del opt.load_parameter_state_from_fully_reshardable


def data_record(cfg: TrainingConfig) -> dict[str, Any]:
    """The data stream a run trains on: the ``--data-path`` blend (prefixes, normalised weights; None for
    ``--mock-data``) and the sampler's settings (its position is the checkpoint's consumed samples)."""
    blend = cfg.data.data_blend
    return {
        "blend": None if blend is None else {"prefixes": list(blend.prefixes), "weights": blend.weights and list(blend.weights)},
        "split": cfg.data.split, "seed": cfg.training.seed, "seq_length": cfg.model.seq_length,
        "global_batch_size": cfg.training.global_batch_size,
    }


def checkpoint_metadata(cfg: TrainingConfig, iteration: int, consumed_samples: int | None = None) -> dict[str, Any]:
    """The record saved beside the shards and compared on ``--load`` (:func:`save_checkpoint` adds the files'
    sizes and checksums, and the record's own)."""
    return {
        "format": FORMAT,
        "iteration": iteration,
        "model": {**{k: getattr(cfg.model, k) for k in MODEL_SHAPE_ARGS}, "padded_vocab_size": padded_vocab_size(cfg)},
        "layout": layout_record(cfg),
        "data": data_record(cfg),
        "consumed_samples": consumed_samples,
    }


def layout_record(cfg: TrainingConfig) -> dict[str, Any]:
    """The parallel layout a checkpoint is saved with: the sizes of :data:`LAYOUT_SIZES`, the optimizer and its
    format (``distrib_optim_sharding_type``: None for the plain optimizer)."""
    sharding = (FULLY_RESHARDABLE if cfg.checkpoint.dist_ckpt_optim_fully_reshardable else DP_RESHARDABLE) \
        if cfg.parallel.use_distributed_optimizer else None
    return {**{key: getattr(cfg.parallel.dims, dims) for key, dims, _ in LAYOUT_SIZES
               if key not in OPTIONAL_SIZES or getattr(cfg.parallel.dims, dims) != 1},
            "use_distributed_optimizer": cfg.parallel.use_distributed_optimizer, "distrib_optim_sharding_type": sharding}


@dataclass(frozen=True)
class Reshard:
    """How ``--load``'s checkpoint meets this run's layout: its layout record (:func:`layout_record`; a checkpoint
    saved before the optimizer format was recorded: ``dp_reshardable`` with the distributed optimizer) and the
    sizes of :data:`LAYOUT_SIZES` that differ, as ``{key: (saved, now)}`` (empty: the same layout)."""

    saved: dict[str, Any]
    changed: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, cfg: TrainingConfig, meta: dict[str, Any]) -> "Reshard":
        saved = dict(meta.get("layout", {}))
        if saved.get("use_distributed_optimizer") and saved.get("distrib_optim_sharding_type") is None:
            saved["distrib_optim_sharding_type"] = DP_RESHARDABLE
        now = layout_record(cfg)
        return cls(saved, {key: (saved.get(key, 1), now.get(key, 1)) for key, _, _ in LAYOUT_SIZES if saved.get(key, 1) != now.get(key, 1)})

    @property
    def stages_kept(self) -> bool:
        """Whether every pipeline stage is as saved (only replica sizes changed): the planner's calibration carries over."""
        return all(key in REPLICA_SIZES for key in self.changed)

    def describe(self, side: int, stages_only: bool = False) -> str:
        """The changed sizes (``stages_only``: but the replica sizes), as saved (``side`` 0) or now (1): ``pp 2, dp 1``."""
        return ", ".join(f"{dims} {self.changed[key][side]}" for key, dims, _ in LAYOUT_SIZES
                         if key in self.changed and not (stages_only and key in REPLICA_SIZES))

    def problem(self, cfg: TrainingConfig) -> str | None:
        """Why the optimizer states cannot load at this layout (loaded: not ``--no-load-optim``/``--finetune``), else None."""
        if cfg.checkpoint.no_load_optim or cfg.checkpoint.finetune:
            return None  # the model alone: its weights are replicated over the context-parallel ranks too
        saved_do = bool(self.saved.get("use_distributed_optimizer"))
        if saved_do != cfg.parallel.use_distributed_optimizer:
            return (f"saved with --use-distributed-optimizer {saved_do}, this run has {cfg.parallel.use_distributed_optimizer}: "
                    "the optimizer states do not convert between the two (--no-load-optim loads the model alone)")
        if saved_do and self.saved["distrib_optim_sharding_type"] == DP_RESHARDABLE \
                and not all(key in OPTIMIZER_REPLICA_SIZES for key in self.changed):
            return (f"saved with {self.describe(0)} and the distributed optimizer's states in megatron-core's dp_reshardable "
                    f"format, which reshards over the data- and context-parallel sizes only; this run has {self.describe(1)} (save with "
                    "--dist-ckpt-optim-fully-reshardable to change the other sizes, or --no-load-optim to load the model alone)")
        return None

    def saved_place(self, runtime: Runtime) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The saved per-rank objects' grid (the sizes the checkpoint recorded, in :data:`LAYOUT_SIZES`' order: a size added
        later is not in an older checkpoint's grid), and the place in it whose object this rank loads: its own rank in
        each size kept, its rank modulo the saved size in each size changed (a replica size: the saved replicas are alike)."""
        recorded = [(key, rank) for key, _, rank in LAYOUT_SIZES if key in self.saved]
        shape = tuple(self.saved[key] for key, _ in recorded)
        return shape, tuple(getattr(runtime, rank) % size for (_, rank), size in zip(recorded, shape))


def reshard_notes(cfg: TrainingConfig, iteration: int) -> list[str]:
    """The lines of a resume at another layout (none at the same one): what is resharded, that the RNG states restart
    from ``--seed`` and the iteration (unless not loaded), and whether the planner's calibration carries over."""
    path = iteration_dir(cfg.checkpoint.load, iteration)
    meta = _read_metadata(path)
    reshard = Reshard.of(cfg, meta)
    if not reshard.changed:
        return []
    where = f"--load {cfg.checkpoint.load}: iteration {iteration}"
    loaded = "the model" if cfg.checkpoint.no_load_optim or cfg.checkpoint.finetune else "the model and optimizer states"
    notes = [f"{where} was saved at {reshard.describe(0)}, this run is at {reshard.describe(1)}: {loaded} resharded"
             + ("" if cfg.checkpoint.finetune else
                f"; the data stream goes on at sample {meta['consumed_samples']}, split over this run's data-parallel replicas")]
    if not (cfg.checkpoint.no_load_rng or cfg.checkpoint.finetune):
        notes.append(f"{where}: the random generators restart from --seed {cfg.training.seed} and iteration {iteration} "
                     "(their saved states are per rank of another layout)")
    if not cfg.checkpoint.finetune and _has_planner_state(path):
        notes.append(f"{where}: the planner's calibration " + (
            "carries over (every pipeline stage as saved)" if reshard.stages_kept else
            f"restarts from the profile (fitted to the stages of {reshard.describe(0, stages_only=True)})"))
    return notes


def _has_planner_state(path: str) -> bool:
    return any(key.startswith(PLANNER_KEY + "/") for key in FileSystemReader(path).read_metadata().state_dict_metadata)


class CheckpointError(RuntimeError):
    """A ``--load`` checkpoint that cannot be trusted (one line, naming the file): main prints it and exits."""


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def record_sha256(meta: dict[str, Any]) -> str:
    """The checksum of ``epp_metadata.json``'s record (all but this field), over its canonical JSON."""
    body = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


_WRITER = re.compile(r"__(\d+)_\d+\.distcp")


def _hashed_by(name: str, rank: int, world_size: int) -> bool:
    """Whether ``rank`` hashes the checkpoint file ``name`` (every file exactly one rank of ``world_size``): the
    ``__R_*.distcp`` files the rank R wrote (at save still in its page cache; on a load of the same layout the shards R
    reads), those of a writer rank this world lacks (a load at a smaller layout) rank R modulo the world size; the
    shared files rank 0."""
    match = _WRITER.fullmatch(name)
    return (int(match.group(1)) % world_size if match else 0) == rank


def _file_problem(path: str, name: str, expected: dict[str, Any]) -> str | None:
    """What is wrong with the checkpoint file ``name`` against its record (``bytes``, ``sha256``), None if it is whole."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        return f"{name}: missing file"
    size = os.path.getsize(file)
    if size != expected["bytes"]:
        return f"{name}: {size} bytes, saved with {expected['bytes']}"
    if "sha256" in expected and _sha256(file) != expected["sha256"]:
        return f"{name}: checksum mismatch (sha256 differs from the one recorded at save)"
    return None


def save_checkpoint(
    cfg: TrainingConfig, model, optimizer, scheduler, runtime: Runtime, iteration: int, consumed: int,
    before_commit: Callable[[], None] | None = None, planner_state: dict[str, Any] | None = None,
) -> str:
    """Write ``--save``'s ``iter_XXXXXXX.tmp``, hash its files (each rank those it wrote), write
    ``epp_metadata.json`` last with their sizes and checksums, then (every rank done) rename it and update
    the tracker. ``before_commit`` runs on every rank after it has written its part (the test-only crash hook);
    ``planner_state``: this rank's planner calibration (``--elastic-pp``)."""
    path = iteration_dir(cfg.checkpoint.save, iteration)
    tmp = path + ".tmp"
    if runtime.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while saving
        os.makedirs(tmp)
    dist.barrier()
    state = _sharded_state(model, optimizer, scheduler, runtime, iteration, consumed, planner_state=planner_state,
                           sharding_type=layout_record(cfg)["distrib_optim_sharding_type"])
    dist_checkpointing.save(state, tmp)
    if before_commit is not None:
        before_commit()
    dist.barrier()  # every rank's files written (rank 0's .metadata, common.pt, metadata.json included)
    mine = {name: {"bytes": os.path.getsize(os.path.join(tmp, name)), "sha256": _sha256(os.path.join(tmp, name))}
            for name in sorted(os.listdir(tmp)) if _hashed_by(name, runtime.rank, runtime.world_size)}
    hashed: list[dict[str, Any]] | None = [{} for _ in range(runtime.world_size)] if runtime.rank == 0 else None
    dist.gather_object(mine, hashed, dst=0)
    if runtime.rank == 0:
        meta = checkpoint_metadata(cfg, iteration, consumed)
        meta["files"] = dict(sorted((name, record) for part in hashed for name, record in part.items()))
        meta["sha256"] = record_sha256(meta)
        _write_durably(os.path.join(tmp, METADATA + ".tmp"), json.dumps(meta, indent=1))
        os.replace(os.path.join(tmp, METADATA + ".tmp"), os.path.join(tmp, METADATA))
        if os.path.isdir(path):  # the same iteration saved again (a resumed run that stops at once)
            os.replace(path, path + ".old")
        os.replace(tmp, path)
        _write_durably(os.path.join(cfg.checkpoint.save, TRACKER + ".tmp"), str(iteration))
        os.replace(os.path.join(cfg.checkpoint.save, TRACKER + ".tmp"), os.path.join(cfg.checkpoint.save, TRACKER))
        shutil.rmtree(path + ".old", ignore_errors=True)
    dist.barrier()
    return path


def _write_durably(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@dataclass
class Resume:
    """What :func:`check_loadable` found in ``--load``: the checkpoints that passed its checks, newest first (the
    tracker's iteration, then with the fallback the older ones), and what is wrong with each one it skipped."""

    root: str
    candidates: list[int]
    skipped: list[str] = field(default_factory=list)


def check_loadable(cfg: TrainingConfig) -> Resume | None:
    """The checkpoints ``--load`` may resume from, None when there is none yet (a first run with ``--load`` =
    ``--save``, the directory not yet created or empty); :class:`ArgumentError` (one line) when it cannot be
    loaded: a foreign checkpoint (another model shape or layout), a bad tracker, or (without the fallback: the
    tracker's checkpoint; with it: every one) a damaged or truncated checkpoint. Reads the metadata and the files'
    sizes only; :func:`choose_verified` checks the checksums."""
    root = cfg.checkpoint.load
    where = f"--load {root}"
    tracker = os.path.join(root, TRACKER)
    committed = sorted((int(d[5:]) for d in os.listdir(root) if re.fullmatch(r"iter_\d{7}", d)), reverse=True) if os.path.isdir(root) else []
    if not os.path.isfile(tracker):
        if committed:
            names = ", ".join(os.path.basename(iteration_dir(root, i)) for i in reversed(committed))
            raise ArgumentError(f"{where}: no {TRACKER} beside {names} (a truncated checkpoint directory)")
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ArgumentError(f"{where}: {TRACKER} holds {text[:40]!r}, not an iteration number")
    latest = int(text)
    order = [latest] + ([i for i in committed if i < latest] if cfg.checkpoint.ckpt_fallback else [])
    resume = Resume(root, [])
    for iteration in order:
        try:
            problem = _checkpoint_problem(cfg, iteration)
        except ArgumentError as error:  # another model shape or layout: an error for the latest, else not a fallback
            if iteration == latest:
                raise
            problem = str(error).split(f"{where}: ", 1)[1]
        if problem is None:
            resume.candidates.append(iteration)
        elif not cfg.checkpoint.ckpt_fallback:
            raise ArgumentError(f"{where}: {problem}")
        else:
            resume.skipped.append(problem)
    if not resume.candidates:
        raise ArgumentError(f"{where}: no checkpoint can be loaded: {'; '.join(resume.skipped)}")
    return resume


def skip_note(root: str, problem: str) -> str:
    """The warning line of a checkpoint the fallback skipped."""
    return f"warning: --load {root}: skipped, {problem}; falling back to the previous checkpoint"


def _checkpoint_problem(cfg: TrainingConfig, iteration: int) -> str | None:
    """Why ``--load``'s ``iteration`` cannot be loaded, as far as its metadata and its files' sizes tell; None if
    they are whole. A checkpoint of another model shape or layout raises :class:`ArgumentError`: that is no damage
    an older checkpoint would mend."""
    path = iteration_dir(cfg.checkpoint.load, iteration)
    if not os.path.isdir(path):
        return f"{TRACKER} names iteration {iteration}, but {path} does not exist"
    if not os.path.isfile(os.path.join(path, METADATA)):
        return f"{path} is not a megatron-epp checkpoint (no {METADATA})"
    meta = _read_metadata(path)
    if not isinstance(meta, dict):
        return f"{path}/{METADATA}: damaged (not valid JSON)"
    if not str(meta.get("format")).startswith("megatron-epp checkpoint"):
        return f"{path} is not a megatron-epp checkpoint (no valid {METADATA})"
    if meta["format"] != FORMAT:  # "megatron-epp checkpoint 1": saved before the files' checksums were recorded
        raise ArgumentError(f"--load {cfg.checkpoint.load}: iteration {iteration} is a {meta['format']!r}, saved by an "
                            f"older megatron-epp without its files' checksums; this version loads {FORMAT!r} only")
    if meta.get("sha256") != record_sha256(meta):
        return f"{path}/{METADATA}: checksum mismatch (its record was changed after save)"
    if meta.get("iteration") != iteration:
        return f"{path} holds iteration {meta.get('iteration')}, its name and {TRACKER} say {iteration}"
    saved_model = meta.get("model", {})
    free = [k for k in FINETUNE_FREE if k != "max_position_embeddings" or cfg.model.position_embedding_type == "rope"] \
        if cfg.checkpoint.finetune else ()
    padded = saved_model.get("padded_vocab_size") or pad_vocab(
        saved_model.get("vocab_size"), saved_model.get("make_vocab_size_divisible_by"), meta.get("layout", {}).get("tensor_model_parallel_size", 1))
    if padded != padded_vocab_size(cfg):
        raise ArgumentError(f"--load {cfg.checkpoint.load}: iteration {iteration} {_vocab_padding(cfg, padded)}")
    for key, want in checkpoint_metadata(cfg, iteration)["model"].items():
        if key in PADDING_ARGS:  # the padded vocabulary is the shape (the flag times tp: it may change with tp)
            continue
        if key in saved_model and saved_model[key] != want and key not in free:  # a flag the checkpoint's version did not record: not compared
            raise ArgumentError(
                f"--load {cfg.checkpoint.load}: iteration {iteration} was saved with --{key.replace('_', '-')} {meta['model'][key]}, "
                f"this run has {want} (a different model shape)"
            )
    layout_problem = Reshard.of(cfg, meta).problem(cfg)  # another layout loads (resharded), but for these optimizer states
    if layout_problem:
        raise ArgumentError(f"--load {cfg.checkpoint.load}: iteration {iteration} was {layout_problem}")
    for name, record in meta["files"].items():
        problem = _file_problem(path, name, {"bytes": record["bytes"]})  # sizes here; checksums in choose_verified
        if problem:
            return f"{path}/{problem}"
    return None


def _vocab_padding(cfg: TrainingConfig, saved: int) -> str:
    """The refusal of a checkpoint whose output layer is padded to ``saved`` rows, not this run's, and the
    ``--make-vocab-size-divisible-by`` that pads this run's vocabulary to them at its tensor-parallel size, if any."""
    tp = cfg.parallel.dims.tp
    fits = [d for d in range(saved // tp, 0, -1) if pad_vocab(cfg.model.vocab_size, d, tp) == saved]
    return (f"has its vocabulary padded to {saved} rows, this run pads it to {padded_vocab_size(cfg)} (--make-vocab-size-divisible-by "
            f"{cfg.model.make_vocab_size_divisible_by} x tp {tp}): a different model shape (the padded rows enter the softmax)"
            + (f"; --make-vocab-size-divisible-by {fits[0]} pads it to {saved} at tp {tp}" if fits else ""))


def choose_verified(cfg: TrainingConfig, resume: Resume, runtime: Runtime) -> tuple[int, list[str]]:
    """Collective: the newest of ``resume``'s candidates whose files match their checksums, and the warning lines
    (one per checkpoint skipped, here or by :func:`check_loadable`); :class:`CheckpointError` (one line,
    the same on every rank) when the tracker's checkpoint is damaged and ``--no-ckpt-fallback`` is given, or none
    verifies. Each rank hashes the files :func:`_hashed_by` gives it; the ranks then share what they found."""
    skipped = list(resume.skipped)
    for iteration in resume.candidates:
        path = iteration_dir(resume.root, iteration)
        meta = _read_metadata(path)
        notes = [skip_note(resume.root, problem) for problem in skipped]
        mine = [_file_problem(path, name, record) for name, record in meta["files"].items()
                if _hashed_by(name, runtime.rank, runtime.world_size)]
        found: list[list[str | None] | None] = [None] * runtime.world_size
        dist.all_gather_object(found, mine)
        problems = sorted(p for part in found for p in part if p)
        if not problems:
            return iteration, notes
        if not cfg.checkpoint.ckpt_fallback:
            raise CheckpointError(f"pretrain_gpt.py: error: --load {resume.root}: {path}/{problems[0]}")
        skipped.append(f"{path}/{problems[0]}")
    raise CheckpointError(f"pretrain_gpt.py: error: --load {resume.root}: no checkpoint verifies: {'; '.join(skipped)}")


def _read_metadata(path: str) -> Any:
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
    meta = _read_metadata(iteration_dir(cfg.checkpoint.load, iteration))
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


def load_checkpoint(
    cfg: TrainingConfig, iteration: int, model, optimizer, scheduler, runtime: Runtime
) -> tuple[int, int, dict[str, Any] | None]:
    """Restore ``--load``'s ``iteration`` (as :func:`choose_verified` chose it); return ``(iteration, consumed_samples,
    this rank's planner calibration)`` (None if the run saved none: no ``--elastic-pp``, or a checkpoint from
    before calibration was saved). As Megatron-LM: ``--no-load-optim`` leaves the optimizer and its LR schedule
    fresh, ``--no-load-rng`` the random states; ``--finetune`` loads the model only and starts at iteration 0 and
    sample 0. A file megatron-core or torch cannot read (only a checkpoint saved without checksums gets that far
    damaged) is a :class:`CheckpointError`."""
    path = iteration_dir(cfg.checkpoint.load, iteration)
    reshard = Reshard.of(cfg, _read_metadata(path))  # another layout: check_loadable refused what cannot reshard
    load_optim = not (cfg.checkpoint.no_load_optim or cfg.checkpoint.finetune)
    if load_optim:
        _init_distributed_optimizer_states(optimizer)
    template = _sharded_state(model, optimizer if load_optim else None, scheduler, runtime, 0, 0, is_loading=True,
                              sharding_type=reshard.saved.get("distrib_optim_sharding_type"))
    try:
        grid = reshard.saved_place(runtime)  # the per-rank objects as saved (a size the checkpoint did not record: not in it)
        if cfg.checkpoint.finetune or not _has_planner_state(path) or not reshard.stages_kept:
            del template["planner"]
        elif reshard.changed:  # every saved rank's calibration (small): dist_checkpointing loads every shard of a ShardedObject or none
            template["planner"] = [ShardedObject(PLANNER_KEY, None, grid[0], place, replica_id=int(runtime.rank != 0))
                                   for place in np.ndindex(*grid[0])]
        else:
            template["planner"] = ShardedObject(PLANNER_KEY, None, *grid, replica_id=0)
        if cfg.checkpoint.no_load_rng or cfg.checkpoint.finetune or reshard.changed:
            del template["rng"]
        else:
            template["rng"] = ShardedObject("rng_state", None, *grid, replica_id=0)
        state = dist_checkpointing.load(template, path)
    except (pickle.UnpicklingError, EOFError, UnicodeDecodeError) as error:  # torch's message would advise weights_only=False
        raise CheckpointError(f"pretrain_gpt.py: error: --load {cfg.checkpoint.load}: {path} is damaged: a file does not unpickle "
                              f"({type(error).__name__})") from None
    model.module.load_state_dict(state["model"])
    if load_optim:
        _load_optimizer(optimizer, state["optimizer"])
        _restore_distributed_optimizer_steps(optimizer)
        scheduler.load_state_dict(state["scheduler"])
    else:
        optimizer.reload_model_params()  # the optimizer's fp32 main params from the loaded model
    if "rng" in state:
        _set_rng_state(state["rng"])
    elif reshard.changed and not (cfg.checkpoint.no_load_rng or cfg.checkpoint.finetune):
        set_seed(cfg.training.seed + state["iteration"], runtime.pp_rank)  # as reshard_notes says
    if cfg.checkpoint.finetune:
        return 0, 0, None
    planner = state.get("planner")
    if isinstance(planner, list):  # another layout, every stage as saved: the saved rank's in this rank's place
        shape, place = reshard.saved_place(runtime)
        planner = planner[list(np.ndindex(*shape)).index(place)]
    return state["iteration"], state["consumed_samples"], planner


def load_model_weights(cfg: TrainingConfig, iteration: int, model, runtime: Runtime) -> None:
    """The model weights of ``--load``'s ``iteration`` only (as :func:`choose_verified` chose it), at this run's layout
    (megatron-core's sharded model state reshards): no optimizer, RNG or planner state (``hf_convert export``)."""
    template = _sharded_state(model, None, None, runtime, 0, 0, is_loading=True)
    del template["rng"], template["planner"]
    model.module.load_state_dict(dist_checkpointing.load(template, iteration_dir(cfg.checkpoint.load, iteration))["model"])
