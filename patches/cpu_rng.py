"""CPU RNG for megatron-core's RNG tracker (``megatron.core.tensor_parallel.random``).

Replaces ``_get_cuda_rng_state``, ``_set_cuda_rng_state`` and ``CudaRNGStatesTracker.add``.
Upstream reads and writes the CUDA generator (``torch.cuda.get_rng_state``), which raises on a
CPU-only build; on CPU the generator dropout draws from is the default CPU generator, so the
tracker's named states (data-parallel, model-parallel, expert) are states of that generator. Forking
and activation checkpointing then restore dropout masks exactly as on GPU. The tracker's warning
"CPU RNG state changed within GPU RNG context" is meaningless when both are the same generator and
is filtered.
"""

from __future__ import annotations

import logging

import torch

from patches._registry import Patch, replace, require_supported_version

MODULE = "megatron.core.tensor_parallel.random"


def _get_rng_state(device: object = "cpu", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _tracker_add(self, name: str, seed: int) -> None:
    """Upstream ``add`` with the CPU generator in place of the CUDA one."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


class _SameGeneratorWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def apply() -> None:
    require_supported_version("cpu_rng", MODULE)
    replace(MODULE, "_get_cuda_rng_state", _get_rng_state)
    replace(MODULE, "_set_cuda_rng_state", _set_rng_state)
    replace(f"{MODULE}:CudaRNGStatesTracker", "add", _tracker_add)
    logging.getLogger(MODULE).addFilter(_SameGeneratorWarningFilter())


PATCH = Patch("cpu_rng", f"{MODULE}._get_cuda_rng_state/_set_cuda_rng_state/CudaRNGStatesTracker.add", __doc__ or "", apply)
