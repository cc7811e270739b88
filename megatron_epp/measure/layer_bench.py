"""Timing and memory measurement of the transformer layer that trains, on this machine.

Used by ``benchmarks/profile_layer.py`` (fits a profile) and ``benchmarks/cost_model_accuracy.py``
(checks it on real chunks).

The layer stack is the library's (:class:`megatron_epp.measure.profiling.LayerStack`, which the GPU
profilers time), here in a one-process group with one thread (:func:`init_single_process`).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from megatron.core import parallel_state

import patches
from megatron_epp.executor.context import ChunkContext
from megatron_epp.executor.memory_tracker import ActivationMemoryTracker
from megatron_epp.measure import profiling


_initialized = False


def init_single_process() -> None:
    """One-process gloo group and Megatron's model-parallel state (TP = PP = 1), one thread, and
    the CPU patches training applies (RoPE's and the recompute's device and RNG calls)."""
    global _initialized
    if _initialized:
        return
    patches.apply_cpu_patches()
    torch.set_num_threads(1)
    if not torch.distributed.is_initialized():
        # an in-memory store: one process needs no rendezvous port (a port taken by another job on the
        # machine made concurrent runs fail with EADDRINUSE)
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    _initialized = True


class LayerStack(profiling.LayerStack):
    """:class:`megatron_epp.measure.profiling.LayerStack` in this one process (:func:`init_single_process` first)."""

    def __init__(self, *args, **kwargs) -> None:
        init_single_process()
        super().__init__(*args, **kwargs)


def time_fwd_bwd(run: Callable[..., torch.Tensor], make_inputs: Callable[[], tuple], repeats: int) -> tuple[float, float]:
    """Fastest forward and backward ms of ``run(*make_inputs())`` over ``repeats`` (inputs made outside
    the timing). Measured as this process's CPU time: with one thread it equals the wall time on an
    idle core, and other processes sharing the machine do not inflate it."""
    fwd, bwd = [], []
    for i in range(repeats + 1):  # the first is a warm-up
        inputs = make_inputs()
        t0 = time.process_time()
        out = run(*inputs)
        t1 = time.process_time()
        (out if out.dim() == 0 else out.sum()).backward()
        t2 = time.process_time()
        if i:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    return min(fwd), min(bwd)


def saved_bytes(build: Callable[[], torch.Tensor], context: ChunkContext | None = None) -> int:
    """Peak bytes of distinct tensors autograd saves for backward while ``build()`` runs, plus the
    prefix K/V ``context`` keeps (none without a context)."""
    with ActivationMemoryTracker(torch.device("cpu"), context or ChunkContext()) as tracker:
        output = build()
    del output
    return tracker.peak_bytes
