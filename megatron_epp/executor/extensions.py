"""Probes of the optional CUDA extensions the stock path can use: Transformer Engine's PyTorch layers
and Megatron's fused softmax kernels (apex / megatron fused kernels).

Import-only (no megatron-core import here): a Transformer Engine whose PyTorch extension is broken
breaks megatron-core's own imports, and ``scripts/setup_gpu.sh`` must still be able to say so.
"""

from __future__ import annotations

import functools
import importlib

# FusedScaleMaskSoftmax imports the first to size its launch and the others to run (causal, padding, no mask)
FUSED_SOFTMAX_MODULES = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda")


def import_failure(module: str) -> str | None:
    """Why ``module`` does not import (None: it does). Any exception counts: a build against another
    torch or CUDA fails with OSError or RuntimeError as often as with ImportError."""
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001
        message = str(error).splitlines()[0] if str(error) else ""
        return f"{module} does not import ({type(error).__name__}: {message})"
    return None


@functools.cache
def probe_transformer_engine() -> str | None:
    """Why Transformer Engine's PyTorch layers do not import (None: they do).

    Probes ``transformer_engine.pytorch``, not ``transformer_engine``: TE's ``__init__`` swallows a
    PyTorch extension that failed to build or load, so the bare package imports where its layers do not.
    """
    return import_failure("transformer_engine.pytorch")


@functools.cache
def probe_fused_softmax() -> str | None:
    """Why Megatron's fused masked softmax kernels do not import (None: they do)."""
    for module in FUSED_SOFTMAX_MODULES:
        why = import_failure(module)
        if why:
            return why
    return None
