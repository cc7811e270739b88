"""Save and load with megatron-core's dist_checkpointing: the sharded model and optimizer, the scheduler, the
iteration, the consumed samples, every rank's RNG state and (``--elastic-pp``) its planner's calibration.

A checkpoint is written to ``iter_0000010.tmp/`` and renamed once every rank has written its part, the tracker file
after it: a run that dies while saving leaves the previous checkpoint named and whole. ``epp_metadata.json``
(:mod:`.records`) is written last (atomically, once every rank has written and hashed its files); a load reads only
what :mod:`.integrity` verified."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_epp.checkpoint.integrity import hashed_by, record_sha256, sha256_of
from megatron_epp.checkpoint.records import (
    DP_RESHARDABLE,
    LAYOUT_SIZES,
    METADATA,
    OPTIONAL_SIZES,
    PLANNER_KEY,
    TRACKER,
    CheckpointError,
    checkpoint_metadata,
    iteration_dir,
    layout_record,
    read_metadata,
)
from megatron_epp.checkpoint.reshard import Reshard, has_planner_state
from megatron_epp.config.fields import TrainingConfig
from megatron_epp.model.runtime import Runtime, set_seed


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


def save_checkpoint(
    cfg: TrainingConfig, model, optimizer, scheduler, runtime: Runtime, iteration: int, consumed: int,
    before_commit: Callable[[], None] | None = None, planner_state: dict[str, Any] | None = None,
    origin: dict[str, Any] | None = None,
) -> str:
    """Write ``--save``'s ``iter_XXXXXXX.tmp``, hash its files (each rank those it wrote), write
    ``epp_metadata.json`` last with their sizes and checksums, then (every rank done) rename it and update
    the tracker. ``before_commit`` runs on every rank after it has written its part (the test-only crash hook);
    ``planner_state``: this rank's planner calibration (``--elastic-pp``); ``origin``: the Hugging Face model it was
    imported from (default: the ``--load`` checkpoint's, :func:`~.records.inherited_origin`)."""
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
    mine = {name: {"bytes": os.path.getsize(os.path.join(tmp, name)), "sha256": sha256_of(os.path.join(tmp, name))}
            for name in sorted(os.listdir(tmp)) if hashed_by(name, runtime.rank, runtime.world_size)}
    hashed: list[dict[str, Any]] | None = [{} for _ in range(runtime.world_size)] if runtime.rank == 0 else None
    dist.gather_object(mine, hashed, dst=0)
    if runtime.rank == 0:
        meta = checkpoint_metadata(cfg, iteration, consumed, origin)
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
    reshard = Reshard.of(cfg, read_metadata(path))  # another layout: check_loadable refused what cannot reshard
    load_optim = not (cfg.checkpoint.no_load_optim or cfg.checkpoint.finetune)
    if load_optim:
        _init_distributed_optimizer_states(optimizer)
    template = _sharded_state(model, optimizer if load_optim else None, scheduler, runtime, 0, 0, is_loading=True,
                              sharding_type=reshard.saved.get("distrib_optim_sharding_type"))
    try:
        grid = reshard.saved_place(runtime)  # the per-rank objects as saved (a size the checkpoint did not record: not in it)
        if cfg.checkpoint.finetune or not has_planner_state(path) or not reshard.stages_kept:
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
