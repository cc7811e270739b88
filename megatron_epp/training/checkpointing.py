"""Save/resume with megatron-core's dist_checkpointing, in Megatron-LM's directory layout.

``SAVE/iter_0000010/`` holds the sharded model and optimizer, the scheduler, the iteration, the
consumed samples and every rank's RNG state; ``SAVE/latest_checkpointed_iteration.txt`` names it.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_epp.training.initialize import Runtime

TRACKER = "latest_checkpointed_iteration.txt"


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
    model, optimizer, scheduler, runtime: Runtime, iteration: int, consumed: int, is_loading: bool = False
) -> dict[str, Any]:
    """What a checkpoint holds; ``is_loading`` makes the optimizer build its (still empty) state first."""
    model_state = model.module.sharded_state_dict()
    layout = (runtime.pp_size, runtime.world_size // (runtime.pp_size * runtime.dp_size), runtime.dp_size)
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed,
        "rng": ShardedObject(
            "rng_state", _rng_state(), layout, (runtime.pp_rank, runtime.tp_rank, runtime.dp_rank), replica_id=0
        ),
    }


def save_checkpoint(root: str, model, optimizer, scheduler, runtime: Runtime, iteration: int, consumed: int) -> str:
    path = iteration_dir(root, iteration)
    if runtime.rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model, optimizer, scheduler, runtime, iteration, consumed), path)
    dist.barrier()
    if runtime.rank == 0:  # atomically: a run killed here still leaves the previous checkpoint named
        with open(os.path.join(root, TRACKER + ".tmp"), "w") as f:
            f.write(str(iteration))
        os.replace(os.path.join(root, TRACKER + ".tmp"), os.path.join(root, TRACKER))
    dist.barrier()
    return path


def latest_iteration(root: str) -> int | None:
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        return int(f.read().strip())


def load_checkpoint(root: str, model, optimizer, scheduler, runtime: Runtime) -> tuple[int, int]:
    """Restore the latest checkpoint under ``root``; return ``(iteration, consumed_samples)``."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"--load {root}: no {TRACKER}")
    template = _sharded_state(model, optimizer, scheduler, runtime, 0, 0, is_loading=True)
    state = dist_checkpointing.load(template, iteration_dir(root, iteration))
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return state["iteration"], state["consumed_samples"]
