"""The default of ``--epp-memory-budget``: what a device can give the planner (model states and activations).

CUDA: the device's free memory at start-up (``torch.cuda.mem_get_info``, after the CUDA context and whatever
other processes hold) less a margin of :data:`CUDA_MARGIN_FRACTION` of the device's memory for what the
planner's count of the allocator's peak leaves out: the caching allocator's reserved-but-unallocated blocks
(fragmentation), NCCL's buffers (allocated outside the allocator when the communicators start, after this
reading), and the step-to-step spread of the measured / predicted activation ratio above the calibrated
factor (the H100 evidence: at most 2.3 % of the activations, 0.34 GB of the llama-like layer's 15 GB). The
planner counts the model states inside the budget (:meth:`CostModel.model_state_bytes`) and plans the
activations in the rest. CPU: 90 % of the host's memory shared by the ranks on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch

from megatron_epp.cost.profiles import GIB

# Not measured yet on a GPU (the H100 evidence has the allocator's allocated peaks, not its reserved ones): a
# GPU run's reserved - allocated peak per step and NCCL's footprint would set it.
CUDA_MARGIN_FRACTION = 0.05
CPU_FRACTION = 0.9


@dataclass(frozen=True)
class DefaultBudget:
    """How the default budget was found (bytes): ``budget = free - margin`` on CUDA, ``0.9 x RAM / ranks`` on CPU."""

    budget: float
    device: str  # "cuda" or "cpu"
    total: float  # the device's memory (CPU: the host's)
    free: float  # CUDA: free at start-up; CPU: the host's memory per rank on it
    margin: float

    def describe(self) -> str:
        if self.device == "cuda":
            return (f"{self.free / GIB:.1f} GB free of {self.total / GIB:.1f} GB on the GPU at start-up - {self.margin / GIB:.1f} GB "
                    f"margin ({100 * CUDA_MARGIN_FRACTION:.0f} % of the GPU: allocator fragmentation, NCCL buffers)")
        return f"{100 * CPU_FRACTION:.0f} % of {self.free / GIB:.1f} GB per rank ({self.total / GIB:.1f} GB RAM / {self.total / self.free:.0f} ranks)"


def default_memory_budget(world_size: int) -> DefaultBudget:
    """The budget a run gets without ``--epp-memory-budget``, on this process's device (``LOCAL_RANK``)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        # a rank past the GPUs is refused before any work (initialize.gpu_oversubscription): read GPU 0 meanwhile
        free, total = torch.cuda.mem_get_info(local_rank if local_rank < torch.cuda.device_count() else 0)
        margin = CUDA_MARGIN_FRACTION * total
        return DefaultBudget(free - margin, "cuda", float(total), float(free), margin)
    total = float(psutil.virtual_memory().total)
    per_rank = total / world_size
    return DefaultBudget(CPU_FRACTION * per_rank, "cpu", total, per_rank, (1 - CPU_FRACTION) * per_rank)
