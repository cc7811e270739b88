"""A stand-in for the name ``torch`` inside one upstream module, sending CUDA-only calls to the CPU.

Megatron-core allocates on ``torch.cuda.current_device()`` or ``device="cuda"`` and synchronises
CUDA streams in a few places that are otherwise device-neutral. Rebinding the module-global ``torch``
of exactly those modules to :class:`CpuTorch` fixes them without copying upstream code, and leaves
``torch`` untouched everywhere else.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator

import torch

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "randint")


def _on_cpu(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return "cpu"
    return device


class _NoStream:
    """CPU has one implicit stream: waiting and recording are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        pass


class _CpuCuda(types.SimpleNamespace):
    """``torch.cuda`` as seen by a patched module."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _cpu_cuda() -> _CpuCuda:
    return _CpuCuda(
        current_device=lambda: "cpu",
        synchronize=lambda *a, **k: None,
        Stream=_NoStream,
        stream=lambda *a, **k: contextlib.nullcontext(),
        default_stream=lambda *a, **k: _NoStream(),
        current_stream=lambda *a, **k: _NoStream(),
        empty_cache=lambda: None,
    )


def _cpu_factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return factory


class CpuTorch(types.ModuleType):
    """Behaves as ``torch`` except that CUDA devices, streams and syncs map to the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _cpu_cuda()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def _tensor_method(name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    original = getattr(torch.Tensor, name)
    setattr(torch.Tensor, name, replacement(original))
    try:
        yield
    finally:
        setattr(torch.Tensor, name, original)


def tensor_cuda_is_identity() -> contextlib.AbstractContextManager[None]:
    """Within the block, ``tensor.cuda()`` returns the tensor itself (it stays on the CPU)."""
    return _tensor_method("cuda", lambda original: lambda self, *a, **k: self)


def tensor_type_reports_cuda() -> contextlib.AbstractContextManager[None]:
    """Within the block, ``tensor.type()`` names CPU tensors as their CUDA type (dtype checks)."""

    def report(original: Callable[..., Any]) -> Callable[..., Any]:
        def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            name = original(self, *args, **kwargs)
            if args or kwargs or self.is_cuda:
                return name
            return name.replace("torch.", "torch.cuda.", 1)

        return type_

    return _tensor_method("type", report)
