"""Runtime patches that let megatron-core 0.16.1 run on CPU with the gloo backend.

Nothing is patched when CUDA is available. Each patch module names the upstream function it
replaces and why; each refuses an unexpected megatron-core version.
"""

from __future__ import annotations

import torch

from patches import cpu_devices, cpu_rng
from patches._registry import SUPPORTED_MCORE_VERSION, Patch, PatchVersionError

CPU_PATCHES: tuple[Patch, ...] = (
    cpu_rng.PATCH,
    cpu_devices.TIED_EMBEDDING,
    cpu_devices.SCHEDULES,
    cpu_devices.P2P,
    cpu_devices.ATTENTION_MASK,
    cpu_devices.GLOBAL_BUFFER,
    cpu_devices.SEQUENCE_PARALLEL,
    cpu_devices.GRAD_BUFFER,
    cpu_devices.ROTARY,
    cpu_devices.OPTIMIZER,
    cpu_devices.GRAD_SCALER,
    cpu_devices.CLIP_GRADS,
    cpu_devices.CLIP_GRADS_TYPE,
    cpu_devices.FP16_OPTIMIZER_TYPE,
    cpu_devices.DISTRIBUTED_OPTIMIZER_TYPE,
    cpu_devices.CHECKPOINT_WRITER,
    cpu_devices.CHECKPOINT_SAVER,
)

_applied: list[str] = []


def apply_cpu_patches(exclude: tuple[str, ...] = ()) -> list[str]:
    """Apply every CPU patch (except ``exclude``) once when CUDA is absent; return the names applied."""
    if torch.cuda.is_available():
        return []
    for patch in CPU_PATCHES:
        if patch.name not in exclude and patch.name not in _applied:
            patch.apply()
            _applied.append(patch.name)
    return list(_applied)


__all__ = ["CPU_PATCHES", "SUPPORTED_MCORE_VERSION", "Patch", "PatchVersionError", "apply_cpu_patches"]
