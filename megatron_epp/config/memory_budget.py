"""The default of ``--epp-memory-budget``: what a device can give the planner (model states and activations).

CUDA: the device's free memory at start-up (``torch.cuda.mem_get_info``, after the CUDA context and whatever
other processes hold) less a margin for what the planner's count of the allocator's peak leaves out, measured on an
H200 on 2026-11-27 (docs/measurements/2026-11-27-h200; pp=1, 40 layers of hidden 2048 at a 32K cap):

* :data:`CUDA_LIBRARY_MARGIN` (3 GiB) for the device memory the CUDA context and libraries take after that reading
  (cuBLAS workspaces, kernels loaded on first use, NCCL's buffers): 0.5 GiB were in use at the reading, 3.17 GiB at
  the out-of-memory error of the second step (CUDA's message: 139.69 GiB in use, 136.52 of them PyTorch's reserve);
  NCCL's buffers of a run with pipeline and data-parallel peers add to it (not measured);
* :data:`CUDA_FRAGMENTATION_SHARE` (3 %) of the free memory for what the caching allocator reserves above what it
  allocates within a step (each step starts from an emptied cache: ``ActivationMemoryTracker``), which the memory
  factor learns only from the measured steps: 0.6-1.6 GiB on single-pipeline steps, 4.1 GiB (4 % of the
  activations) on a three-pipeline step.

That makes 7.2 GiB on an H200 (139.3 GiB free), 5.4 on an H100 (79 free). The planner counts the model states inside
the budget (:meth:`CostModel.model_state_bytes`) and plans the activations in the rest. CPU: 90 % of the host's memory
shared by the ranks on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch

from megatron_epp.base.units import GIB

CUDA_LIBRARY_MARGIN = 3.0 * GIB  # the CUDA context and libraries' growth after the start-up reading (measured 2.7 GiB)
CUDA_FRAGMENTATION_SHARE = 0.03  # of the free memory: reserved above allocated within a step (measured up to 4 % of it)
CPU_FRACTION = 0.9


@dataclass(frozen=True)
class DefaultBudget:
    """How the default budget was found (bytes): ``budget = free - margin`` on CUDA (``margin`` = 3 GiB + 3 % of ``free``),
    ``0.9 x RAM / ranks`` on CPU."""

    budget: float
    device: str  # "cuda" or "cpu"
    total: float  # the device's memory (CPU: the host's)
    free: float  # CUDA: free at start-up; CPU: the host's memory per rank on it
    margin: float

    def describe(self) -> str:
        if self.device == "cuda":
            return (f"{self.free / GIB:.1f} GB free of {self.total / GIB:.1f} GB on the GPU at start-up - {self.margin / GIB:.1f} GB "
                    f"margin ({CUDA_LIBRARY_MARGIN / GIB:.0f} GB for the CUDA libraries' later use + "
                    f"{100 * CUDA_FRAGMENTATION_SHARE:.0f} % of the free memory for the allocator's fragmentation)")
        return f"{100 * CPU_FRACTION:.0f} % of {self.free / GIB:.1f} GB per rank ({self.total / GIB:.1f} GB RAM / {self.total / self.free:.0f} ranks)"


@dataclass(frozen=True)
class MemoryReading:
    """What this process's device has (bytes), read once at start-up: the input of the default budget. CUDA: the
    GPU's memory and what is free of it; CPU: the host's RAM and what is available of it (the CPU budget reads only
    the RAM). Tests fix it (``tests/conftest.py``): nothing a test expects depends on the machine it runs on."""

    device: str  # "cuda" or "cpu"
    total: float
    free: float

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu") or not 0 <= self.free <= self.total or self.total <= 0:
            raise ValueError(f"a memory reading of {self.free:g} bytes free of {self.total:g} on {self.device!r} is not one")


def read_memory() -> MemoryReading:
    """This process's device (``LOCAL_RANK``'s GPU where CUDA is available, else the host), read now."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        # a rank past the GPUs is refused before any work (initialize.gpu_oversubscription): read GPU 0 meanwhile
        free, total = torch.cuda.mem_get_info(local_rank if local_rank < torch.cuda.device_count() else 0)
        return MemoryReading("cuda", float(total), float(free))
    host = psutil.virtual_memory()
    return MemoryReading("cpu", float(host.total), float(host.available))


def default_memory_budget(world_size: int, reading: MemoryReading) -> DefaultBudget:
    """The budget a run gets without ``--epp-memory-budget``, on a device that reads ``reading``."""
    if reading.device == "cuda":
        margin = CUDA_LIBRARY_MARGIN + CUDA_FRAGMENTATION_SHARE * reading.free
        return DefaultBudget(reading.free - margin, "cuda", reading.total, reading.free, margin)
    per_rank = reading.total / world_size
    return DefaultBudget(CPU_FRACTION * per_rank, "cpu", reading.total, per_rank, (1 - CPU_FRACTION) * per_rank)
