"""Process group, device, Megatron-Core model-parallel state and seeds."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import patches
from megatron.core import tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_epp.base.dims import ParallelDims
from megatron_epp.config.fields import TrainingConfig


@dataclass(frozen=True)
class Runtime:
    """Where this rank runs, what it is in the parallel layout ``dims`` (its sizes and world size) and its
    process groups ``pg_collection`` (megatron-core's :class:`ProcessGroupCollection`, :func:`process_groups`): what
    the schedule, the layers and the driver communicate over. None only in a runtime made by hand for one process
    (a test building a model: megatron-core's layers then take its default groups)."""

    device: torch.device
    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    dims: ParallelDims
    cp_rank: int = 0  # this rank's index in its context-parallel group (its share of each chunk's tokens)
    pg_collection: ProcessGroupCollection | None = None

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """Megatron logs from the last rank: it holds the loss."""
        return self.rank == self.world_size - 1


def local_world_size() -> int:
    """Processes on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 for a plain process)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_oversubscription(local_world_size: int, device_count: int) -> str | None:
    """Why ``local_world_size`` processes on a node cannot each have their own GPU among
    ``device_count`` (None: they can, or there is no GPU and they run on the CPU).

    One process per GPU: rank ``r`` of a node takes ``cuda:r``, so more ranks than GPUs would ask
    for a device that does not exist, and two ranks on one GPU are refused by NCCL ("Duplicate GPU
    detected"). One GPU means pp=1 (the elastic slicing and packing still run there).
    """
    if device_count == 0 or local_world_size <= device_count:
        return None
    return (
        f"{local_world_size} processes on this node but {device_count} GPU{'s' if device_count > 1 else ''}: "
        f"one process per GPU (torchrun --nproc-per-node {device_count}, or CUDA_VISIBLE_DEVICES)"
    )


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_DEFAULT = "expandable_segments:True"


def configure_cuda_allocator(environ=os.environ, cuda: bool | None = None) -> str | None:
    """Before anything touches CUDA (the caching allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` when it starts): on a
    CUDA machine, ``expandable_segments:True`` unless the variable is set already. The chunks' shapes change every
    step, and the default allocator's fixed segments then fragment: what it reserves from the device (what runs
    out) grows beyond what it has allocated; expandable segments grow and shrink in place. Returns the start-up line
    (None on a machine without CUDA, where nothing is set)."""
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return None
    if environ.get(ALLOC_CONF):
        return f"CUDA allocator: {ALLOC_CONF}={environ[ALLOC_CONF]} (as set in the environment)"
    environ[ALLOC_CONF] = ALLOC_DEFAULT
    return (f"CUDA allocator: {ALLOC_CONF}={ALLOC_DEFAULT} (set by pretrain_gpt.py: chunk shapes change every step, and "
            f"fixed segments fragment; set {ALLOC_CONF} to choose otherwise)")


def select_device() -> tuple[torch.device, str]:
    """CUDA with NCCL when a GPU is present, else CPU with gloo and the CPU patches.

    ``EPP_DISABLE_PATCHES=name,...`` leaves named patches out (to check whether upstream still needs them).
    """
    if torch.cuda.is_available():
        why = gpu_oversubscription(local_world_size(), gpu_count())
        if why:
            raise RuntimeError(why)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    torch.set_num_threads(int(os.environ.get("EPP_THREADS_PER_RANK", "1")))
    disabled = tuple(filter(None, os.environ.get("EPP_DISABLE_PATCHES", "").split(",")))
    patches.apply_cpu_patches(exclude=disabled)
    return torch.device("cpu"), "gloo"


def set_seed(seed: int, pp_rank: int) -> None:
    """Megatron's seeding: a different stream per pipeline stage, tracked model-parallel RNG."""
    seed = seed + 100 * pp_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# the groups of a rank's ProcessGroupCollection: the model's (tensor, context, pipeline, embeddings), the model-parallel
# group a replica's plan is shared over, the data-parallel ones (gradients and the loss over DP x CP), and the expert
# groups megatron-core's DDP asks for (of size 1: no experts here)
PROCESS_GROUPS = ("tp", "cp", "tp_cp", "pp", "mp", "embd", "pos_embd", "dp", "dp_cp", "ep", "expt_dp")


def process_groups() -> ProcessGroupCollection:
    """This rank's :data:`PROCESS_GROUPS` of megatron-core's initialized model-parallel state, as megatron-core
    collects them (``ProcessGroupCollection.use_mpu_process_groups``)."""
    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=list(PROCESS_GROUPS))


def initialize(cfg: TrainingConfig) -> Runtime:
    """Start torch.distributed (torchrun's env, or a single process) and megatron-core's groups; a
    collective that waits longer than ``--distributed-timeout-minutes`` raises (the rank exits non-zero
    and torchrun ends the others)."""
    device, backend = select_device()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            backend,
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            timeout=timedelta(minutes=cfg.parallel.distributed_timeout_minutes),
        )
    dims = cfg.parallel.dims
    try:
        dims.check_world_size(dist.get_world_size())
    except ValueError as e:
        raise RuntimeError(f"the launch does not fit the configuration: {e}") from None
    # megatron-core's order (tp-cp-ep-dp-pp): a pipeline group holds ranks of one CP index, so stage-to-stage sends go
    # rank to rank within it; gradients are reduced (and the distributed optimizer sharded) over DP x CP
    ps.initialize_model_parallel(
        dims.tp, dims.pp, context_parallel_size=dims.cp,
        distributed_timeout_minutes=cfg.parallel.distributed_timeout_minutes,
    )
    groups = process_groups()
    megatron_sizes = (groups.tp.size(), groups.cp.size(), groups.pp.size(), groups.dp.size(), dist.get_world_size())
    if megatron_sizes != (dims.tp, dims.cp, dims.pp, dims.dp, dims.world_size):
        raise RuntimeError(f"megatron-core's groups (tp, cp, pp, dp, world) {megatron_sizes} are not the configuration's {dims!r}")
    runtime = Runtime(
        device=device,
        rank=dist.get_rank(),
        pp_rank=groups.pp.rank(),
        tp_rank=groups.tp.rank(),
        dp_rank=groups.dp.rank(),
        dims=dims,
        cp_rank=groups.cp.rank(),
        pg_collection=groups,
    )
    set_seed(cfg.training.seed, runtime.pp_rank)
    return runtime


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
