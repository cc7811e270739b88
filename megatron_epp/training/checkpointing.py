"""Save/resume with megatron-core's dist_checkpointing, in Megatron-LM's directory layout.

``SAVE/iter_0000010/`` holds the sharded model and optimizer, the scheduler, the iteration, the
consumed samples, every rank's RNG state and (``--elastic-pp``) its planner's calibration, and
``epp_metadata.json`` (the model shape and the parallel layout it was saved with, and the data stream it
was trained on: the ``--data-path`` blend and the sampler's settings and position);
``SAVE/latest_checkpointed_iteration.txt`` names it.

A checkpoint is written to ``iter_0000010.tmp/`` and renamed once every rank has written its part,
the tracker file after it: a run that dies while saving leaves the previous checkpoint named and
whole. :func:`check_loadable` refuses, before any process group exists, a ``--load`` that is
truncated (tracker, directory or files missing) or foreign (not ours, another model shape or layout);
:func:`data_change` words, as a warning, a resume on another data stream (Megatron-LM allows it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.distributed.checkpoint import FileSystemReader

from megatron_epp.data.blend import Blend
from megatron_epp.training.arguments import ArgumentError
from megatron_epp.training.initialize import Runtime

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "epp_metadata.json"
FORMAT = "megatron-epp checkpoint 1"
# What a checkpoint must agree on with the run that loads it (a flag this version lacks reads as None on both sides)
MODEL_SHAPE_ARGS = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
    "position_embedding_type", "vocab_size", "untie_embeddings_and_output_weights", "swiglu", "normalization",
    "group_query_attention", "num_query_groups", "kv_channels", "add_bias_linear", "rotary_base", "make_vocab_size_divisible_by",
)
LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size", "use_distributed_optimizer")
# What the sample stream is a function of, besides the blend and its position (the consumed samples)
SAMPLER_ARGS = ("split", "seed", "seq_length", "global_batch_size")
# --use-distributed-optimizer: each rank's shard of the optimizer states saved in model space (one tensor per
# parameter, resharded on load), not megatron-core's default flat-range format, which dist_checkpointing
# 0.16.1 no longer accepts ("ShardedTensor.flattened_range is not supported")
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
PLANNER_KEY = "epp_planner_state"


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
    planner_state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a checkpoint holds; ``is_loading`` makes the optimizer build its (still empty) state first."""
    model_state = model.module.sharded_state_dict()
    layout = (runtime.pp_size, runtime.world_size // (runtime.pp_size * runtime.dp_size), runtime.dp_size)
    here = (runtime.pp_rank, runtime.tp_rank, runtime.dp_rank)
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=OPTIMIZER_METADATA),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed,
        "rng": ShardedObject("rng_state", _rng_state(), layout, here, replica_id=0),
        # the elastic planner's online calibration (training.elastic.PlanBuilder.state_dict; None without --elastic-pp)
        "planner": ShardedObject(PLANNER_KEY, planner_state, layout, here, replica_id=0),
    }


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
                    if state and "step" in state:
                        state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def data_record(args: argparse.Namespace) -> dict[str, Any]:
    """The data stream a run trains on: the ``--data-path`` blend (prefixes, normalised weights; None for
    ``--mock-data``) and the sampler's settings (its position is the checkpoint's consumed samples)."""
    blend = args.data_blend
    return {
        "blend": None if blend is None else {"prefixes": list(blend.prefixes), "weights": blend.weights and list(blend.weights)},
        **{k: getattr(args, k) for k in SAMPLER_ARGS},
    }


def checkpoint_metadata(args: argparse.Namespace, iteration: int, consumed_samples: int | None = None) -> dict[str, Any]:
    """The record saved beside the shards and compared on ``--load``."""
    return {
        "format": FORMAT,
        "iteration": iteration,
        "model": {k: getattr(args, k, None) for k in MODEL_SHAPE_ARGS},
        "layout": {k: getattr(args, k) for k in LAYOUT_ARGS},
        "data": data_record(args),
        "consumed_samples": consumed_samples,
    }


def save_checkpoint(
    args: argparse.Namespace, model, optimizer, scheduler, runtime: Runtime, iteration: int, consumed: int,
    before_commit: Callable[[], None] | None = None, planner_state: dict[str, Any] | None = None,
) -> str:
    """Write ``--save``'s ``iter_XXXXXXX.tmp``, then (every rank done) rename it and update the tracker.
    ``before_commit`` runs on every rank after it has written its part (the test-only crash hook);
    ``planner_state``: this rank's planner calibration (``--elastic-pp``)."""
    path = iteration_dir(args.save, iteration)
    tmp = path + ".tmp"
    if runtime.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while saving
        os.makedirs(tmp)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model, optimizer, scheduler, runtime, iteration, consumed, planner_state=planner_state), tmp)
    if before_commit is not None:
        before_commit()
    dist.barrier()
    if runtime.rank == 0:
        _write_durably(os.path.join(tmp, METADATA), json.dumps(checkpoint_metadata(args, iteration, consumed), indent=1))
        if os.path.isdir(path):  # the same iteration saved again (a resumed run that stops at once)
            os.replace(path, path + ".old")
        os.replace(tmp, path)
        _write_durably(os.path.join(args.save, TRACKER + ".tmp"), str(iteration))
        os.replace(os.path.join(args.save, TRACKER + ".tmp"), os.path.join(args.save, TRACKER))
        shutil.rmtree(path + ".old", ignore_errors=True)
    dist.barrier()
    return path


def _write_durably(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def check_loadable(args: argparse.Namespace) -> int | None:
    """The iteration ``--load`` resumes from, None when the directory holds no checkpoint yet (a first
    run with ``--load`` = ``--save``); :class:`ArgumentError` (one line) when it cannot be loaded."""
    root = args.load
    where = f"--load {root}"
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        committed = sorted(d for d in os.listdir(root) if re.fullmatch(r"iter_\d{7}", d))
        if committed:
            raise ArgumentError(f"{where}: no {TRACKER} beside {', '.join(committed)} (a truncated checkpoint directory)")
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ArgumentError(f"{where}: {TRACKER} holds {text[:40]!r}, not an iteration number")
    iteration = int(text)
    path = iteration_dir(root, iteration)
    if not os.path.isdir(path):
        raise ArgumentError(f"{where}: {TRACKER} names iteration {iteration}, but {path} does not exist")
    meta = _read_metadata(path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ArgumentError(f"{where}: {path} is not a megatron-epp checkpoint (no valid {METADATA})")
    if meta["iteration"] != iteration:
        raise ArgumentError(f"{where}: {path} holds iteration {meta['iteration']}, its name and {TRACKER} say {iteration}")
    expected = checkpoint_metadata(args, iteration)
    for part in ("model", "layout"):
        for key, want in expected[part].items():
            if meta[part].get(key) != want:
                raise ArgumentError(
                    f"{where}: iteration {iteration} was saved with --{key.replace('_', '-')} {meta[part].get(key)}, "
                    f"this run has {want} (a different {'model shape' if part == 'model' else 'parallel layout'})"
                )
    missing = _missing_files(path)
    if missing:
        raise ArgumentError(f"{where}: {path} is truncated: {missing}")
    return iteration


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


def data_change(args: argparse.Namespace, iteration: int) -> str | None:
    """One warning line when this run's data stream differs from the one ``--load``'s ``iteration`` (as
    :func:`check_loadable` found it) was trained on: another ``--data-path`` blend (prefixes or weights) or
    sampler setting. None when they agree (or the checkpoint predates the record).

    Not an error: Megatron-LM compares only the model and the parallel layout on load and rebuilds the blend
    from the new flags at the checkpoint's consumed samples, which is how a job anneals on another mixture.
    The stream then goes on from that position of the new blend's stream: what was drawn before is not
    tracked per dataset, so some documents may come again and others never."""
    meta = _read_metadata(iteration_dir(args.load, iteration))
    saved = meta.get("data") if isinstance(meta, dict) else None
    if saved is None:
        return None
    now = data_record(args)
    changes = [f"--data-path {_describe_blend(saved['blend'])} -> {_describe_blend(now['blend'])}"] if saved["blend"] != now["blend"] else []
    changes += [f"--{k.replace('_', '-')} {saved[k]} -> {now[k]}" for k in SAMPLER_ARGS if saved.get(k) != now[k]]
    if not changes:
        return None
    return (f"warning: --load {args.load}: iteration {iteration} was trained on other data ({'; '.join(changes)}); "
            f"training goes on at sample {meta['consumed_samples']} of this run's stream, as in Megatron-LM: samples "
            "drawn before are not replayed or skipped by dataset, so some documents may repeat and others never come")


def _missing_files(path: str) -> str | None:
    """What of a dist_checkpointing (torch_dist) directory is absent or shorter than its metadata says."""
    for name in ("metadata.json", "common.pt", ".metadata"):
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} missing"
    try:
        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as error:  # an unreadable .metadata: whatever torch raises for it
        return f".metadata unreadable ({type(error).__name__})"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} missing"
        if os.path.getsize(file) < size:
            return f"{name} holds {os.path.getsize(file)} bytes, its metadata needs {size}"
    return None


def load_checkpoint(
    root: str, iteration: int, model, optimizer, scheduler, runtime: Runtime
) -> tuple[int, int, dict[str, Any] | None]:
    """Restore ``root``'s ``iteration`` (as :func:`check_loadable` found it); return ``(iteration, consumed_samples,
    this rank's planner calibration)`` (None if the run saved none: no ``--elastic-pp``, or a checkpoint from
    before calibration was saved)."""
    _init_distributed_optimizer_states(optimizer)
    path = iteration_dir(root, iteration)
    template = _sharded_state(model, optimizer, scheduler, runtime, 0, 0, is_loading=True)
    if not any(key.startswith(PLANNER_KEY + "/") for key in FileSystemReader(path).read_metadata().state_dict_metadata):
        del template["planner"]
    state = dist_checkpointing.load(template, path)
    model.module.load_state_dict(state["model"])
    with torch.no_grad():  # the distributed optimizer copies into its fp32 shards, views of the parameters
        optimizer.load_state_dict(state["optimizer"])
    _restore_distributed_optimizer_steps(optimizer)
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return state["iteration"], state["consumed_samples"], state.get("planner")
