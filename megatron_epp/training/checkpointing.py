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
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_epp.training.initialize import Runtime

TRACKER = "latest_checkpointed_iteration.txt"
# --use-distributed-optimizer: each rank's shard of the optimizer states saved in model space (one tensor per
# parameter, resharded on load), not megatron-core's default flat-range format, which dist_checkpointing
# 0.16.1 no longer accepts ("ShardedTensor.flattened_range is not supported")
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


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
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=OPTIMIZER_METADATA),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed,
        "rng": ShardedObject(
            "rng_state", _rng_state(), layout, (runtime.pp_rank, runtime.tp_rank, runtime.dp_rank), replica_id=0
        ),
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
    _init_distributed_optimizer_states(optimizer)
    template = _sharded_state(model, optimizer, scheduler, runtime, 0, 0, is_loading=True)
    state = dist_checkpointing.load(template, iteration_dir(root, iteration))
    model.module.load_state_dict(state["model"])
    with torch.no_grad():  # the distributed optimizer copies into its fp32 shards, views of the parameters
        optimizer.load_state_dict(state["optimizer"])
    _restore_distributed_optimizer_steps(optimizer)
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return state["iteration"], state["consumed_samples"]
