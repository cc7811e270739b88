"""FlashAttention 4 (the ``flash-attn-4`` package: CuTe DSL kernels for Hopper and Blackwell) as a kernel of the
elastic attention: its import probe, its on-disk compile cache, and the start-up numerical probe that also compiles
the run's kernel variants before the first step.

``flash_attn.cute.flash_attn_varlen_func`` takes ``cu_seqlens_q`` and ``cu_seqlens_k`` apart (a split slice's queries
over its K/V prefix and its own keys), aligns ``causal=True`` bottom-right (what a slice with context needs), packs
grouped-query heads without expanding K/V, and runs forward and backward on sm90 and sm100 in bf16/fp16 (head dims
8-256 on sm90). It has no dropout. Its kernels are compiled on first use, one variant per (head dim, query heads per
K/V head, causal, dtype, architecture): tens of seconds each, never per length. :func:`configure_compile_cache` turns
its disk cache on under the run's cache directory (before it is imported: it reads the variables once), and
:func:`probe` runs a small batched + split layout of the run's head shape through it, forward and backward, against an
fp32 reference on the same device: the kernel is chosen only where that passes, and the probe's time (the compiles
and the cache reads) is printed on the start-up line.

Nothing here imports the package at module level; tests substitute a reference kernel (:class:`CuteFlashKernel`
with ``devices=("cpu",)``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch

from megatron_epp.executor.context import VarlenSeqlens, bottom_right_causal_mask

DISTRIBUTION = "flash-attn-4"
MODULE = "flash_attn.cute"
CACHE_ENABLED = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
CACHE_DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
ARCHITECTURES = (9, 10)  # compute capability majors with forward and backward: Hopper (sm90), Blackwell (sm100)
# the probe's bound on the worst relative error (max |kernel - fp32| / max |fp32|) of the output and the three
# gradients: 16-bit inputs round at 2^-8 (bf16); the kernels measured against fp32 on an H200 reach 5e-3 (torch-varlen)
PROBE_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
# the probe's layout: a document of 40 tokens alone, then a slice of 24 tokens over its sequence's 32-token prefix
PROBE_SEGMENTS = ((40, 0), (24, 32))


@dataclass(frozen=True)
class CuteFlashKernel:
    """``flash_attn.cute.flash_attn_varlen_func`` and where it runs (tests substitute a reference implementation)."""

    varlen_func: Callable[..., tuple]
    version: str
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    architectures: tuple[int, ...] | None = ARCHITECTURES
    label: ClassVar[str] = "flash-attn-4"

    def unsupported(self, device: torch.device, dtype: torch.dtype, dropout: float = 0.0) -> str | None:
        """Why the kernel cannot take tensors of ``device``/``dtype`` under attention dropout ``dropout`` (None: it can)."""
        if device.type not in self.devices:
            return f"tensors on {device.type}, {self.label} runs on {'/'.join(self.devices)}"
        if dtype not in self.dtypes:
            names = "/".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"dtype {str(dtype).removeprefix('torch.')}, {self.label} takes {names}"
        if dropout > 0:
            return f"attention dropout {dropout:g}, which {self.label} has not"
        if device.type == "cuda" and self.architectures is not None:
            major, minor = torch.cuda.get_device_capability(device)
            if major not in self.architectures:
                return f"GPU compute capability {major}.{minor}: {self.label} runs on sm90 (Hopper) and sm100 (Blackwell)"
        return None

    def attend(self, q, k, v, seqlens, scale: float, deterministic: bool = False) -> torch.Tensor:
        """One packed chunk: ``q`` ``[N, heads, d]``, ``k``/``v`` ``[N + C, kv_heads, d]``, bottom-right causal per
        ``seqlens`` (:class:`~megatron_epp.executor.context.VarlenSeqlens`); ``[N, heads, d]`` out. ``num_splits=1``
        (the split-K path asserts on sm90 and is for decoding)."""
        out, _ = self.varlen_func(
            q, k, v, cu_seqlens_q=seqlens.cu_seqlens_q, cu_seqlens_k=seqlens.cu_seqlens_k, max_seqlen_q=seqlens.max_seqlen_q,
            max_seqlen_k=seqlens.max_seqlen_k, softmax_scale=scale, causal=True, num_splits=1, deterministic=deterministic,
        )
        return out


def configure_compile_cache(directory: str | Path) -> str:
    """Turn flash-attn-4's on-disk compile cache on, in ``directory``, unless the environment already says how; the
    start-up line's words for it. Effective only before the package is imported (it reads the variables once)."""
    if MODULE in sys.modules:
        return f"compile cache as {MODULE} found it at its import ({os.environ.get(CACHE_ENABLED, '0')}=enabled)"
    if CACHE_ENABLED in os.environ:
        return f"compile cache {'on' if os.environ[CACHE_ENABLED] == '1' else 'off'} ({CACHE_ENABLED}={os.environ[CACHE_ENABLED]} set)"
    os.environ[CACHE_ENABLED] = "1"
    os.environ.setdefault(CACHE_DIR, str(directory))
    return f"compile cache {os.environ[CACHE_DIR]}"


def load_kernel() -> tuple[CuteFlashKernel | None, str]:
    """``(kernel, "")`` where ``flash_attn.cute`` imports, else ``(None, why not)`` (probed once)."""
    return _import()


@functools.cache
def _import() -> tuple[CuteFlashKernel | None, str]:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as error:  # ImportError, or its CUDA libraries missing (OSError, RuntimeError)
        message = str(error).splitlines()[0] if str(error) else ""
        return None, f"{DISTRIBUTION} does not import ({type(error).__name__}: {message})"
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    return CuteFlashKernel(flash_attn_varlen_func, version), ""


@dataclass(frozen=True)
class ProbeResult:
    """The numerical probe of one head shape: ``why`` it failed ("" where it passed), its worst relative error
    against fp32 and the seconds it took (the kernels' compiles or cache reads included)."""

    why: str
    error: float
    seconds: float

    def note(self) -> str:
        return f"compiled and probed in {self.seconds:.1f} s, worst error {self.error:.1e} against fp32"


def reference(q, k, v, segments, scale: float) -> torch.Tensor:
    """fp32 attention of packed ``q`` over packed ``k``/``v`` (GQA by repetition), each ``(s, C)`` of ``segments`` a
    segment of ``s`` queries over ``C + s`` keys, bottom-right causal."""
    group = q.shape[1] // k.shape[1]
    outputs, row_q, row_k = [], 0, 0
    for s, context in segments:
        qi = q[row_q:row_q + s].float().transpose(0, 1)
        ki, vi = (t[row_k:row_k + context + s].float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        scores = (qi @ ki.transpose(1, 2)) * scale
        mask = bottom_right_causal_mask(s, context, q.device)
        outputs.append((scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vi).transpose(0, 1))
        row_q, row_k = row_q + s, row_k + context + s
    return torch.cat(outputs)


def _worst(kernel_tensors, reference_tensors) -> float:
    return max(float((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(kernel_tensors, reference_tensors))


def probe(kernel: CuteFlashKernel, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
          deterministic: bool = False) -> ProbeResult:
    """The probe of ``kernel`` for one head shape on ``device`` (once per shape and process): :data:`PROBE_SEGMENTS`
    through :meth:`CuteFlashKernel.attend`, output and ``dq``/``dk``/``dv`` against :func:`reference`."""
    return _probe(kernel, device, dtype, heads, kv_heads, head_dim, deterministic)


@functools.cache
def _probe(kernel, device, dtype, heads, kv_heads, head_dim, deterministic) -> ProbeResult:
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    rows_q, rows_k = sum(s for s, _ in PROBE_SEGMENTS), sum(s + c for s, c in PROBE_SEGMENTS)
    q, k, v, grad = (torch.randn(rows, h, head_dim, generator=generator).to(device, dtype)
                     for rows, h in ((rows_q, heads), (rows_k, kv_heads), (rows_k, kv_heads), (rows_q, heads)))
    cu_q, cu_k = [0, PROBE_SEGMENTS[0][0], rows_q], [0, PROBE_SEGMENTS[0][0], rows_k]
    seqlens = VarlenSeqlens(torch.tensor(cu_q, dtype=torch.int32, device=device), torch.tensor(cu_k, dtype=torch.int32, device=device),
                            max(s for s, _ in PROBE_SEGMENTS), max(s + c for s, c in PROBE_SEGMENTS))
    scale = 1.0 / math.sqrt(head_dim)
    try:
        tested = _forward_backward(lambda a, b, c: kernel.attend(a, b, c, seqlens, scale, deterministic), q, k, v, grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as error:  # noqa: BLE001 - a kernel that cannot compile or run here is not chosen, and says why
        message = str(error).splitlines()[0] if str(error) else ""
        return ProbeResult(f"its probe failed ({type(error).__name__}: {message[:200]})", math.inf, time.perf_counter() - start)
    wanted = _forward_backward(lambda a, b, c: reference(a, b, c, PROBE_SEGMENTS, scale), *(t.float() for t in (q, k, v, grad)))
    error = _worst(tested, wanted)
    tolerance = PROBE_TOLERANCE.get(dtype, 1e-5)
    why = "" if error <= tolerance else f"its probe is off: worst error {error:.2e} against fp32 > {tolerance:g}"
    return ProbeResult(why, error, time.perf_counter() - start)


def _forward_backward(attend, q, k, v, grad) -> list[torch.Tensor]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def reset() -> None:
    """Forget the import and the probes (tests)."""
    _import.cache_clear()
    _probe.cache_clear()
