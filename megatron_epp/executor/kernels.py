"""The kernels behind :class:`ElasticAttention`, and the one decision of which runs (:func:`decide`).

Six ways to compute a chunk's attention (block-diagonal causal over its segments, the slice's queries also seeing
its prefix K/V, placed before its own keys): ``sdpa-merged`` (CPU), ``sdpa-masked``, ``sdpa-causal``,
``fa4-varlen`` (FlashAttention 4, :mod:`~megatron_epp.executor.fa4`), ``flash-varlen`` and ``torch-varlen``. Every kernel takes the slice's keys and values as ``slice_kv``: rows
``[0, C + s)`` of its sequence's K/V buffer (prefix, then its own), which stand in for its rows of the chunk's
``key``/``value``. When each runs, what it computes and saves, its GQA modes and what was measured of it are in
docs/gpu.md ("What the CUDA path does").

``EPP_ATTENTION_BACKEND=auto|sdpa|fa4|flash|varlen`` (default ``auto``) is read when the attention is built; the choice
is printed once per (request, device, dtype, with or without attention dropout, with or without GQA). What decides is
:func:`decide`, a pure function of the request, the device, dtype, dropout, GQA and the two kernels as probed
(:func:`fa4.load_kernel` with its numerical probe, :func:`load_flash_kernel`, :func:`load_torch_varlen` with the aten
flash ops of :func:`load_aten_flash_ops`; tests substitute reference kernels and ops).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from megatron_epp.executor import fa4
from megatron_epp.executor.context import ChunkView, bottom_right_causal_mask

ENV = "EPP_ATTENTION_BACKEND"
REQUESTS = ("auto", "sdpa", "fa4", "flash", "varlen")
NO_FA4 = (None, "")  # flash-attn-4 not considered (the decision's default: no words about it)
FLASH_MIN_VERSION = (2, 1)  # causal=True is bottom-right aligned from 2.1 on (top-left before)
# SDPA's kernels for the per-segment paths: never cuDNN attention (a graph built per new shape)
SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class AttentionBackendError(RuntimeError):
    """The requested attention backend cannot run here."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class VarlenKernel:
    """A varlen attention function (the whole chunk in one call) and where it runs."""

    varlen_func: Callable[..., torch.Tensor]
    version: str
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    min_capability: tuple[int, int] | None = (8, 0)  # flash attention 2: Ampere or newer
    label: ClassVar[str] = "a varlen kernel"
    has_dropout: ClassVar[bool] = True

    def unsupported(self, device: torch.device, dtype: torch.dtype, dropout: float = 0.0) -> str | None:
        """Why this kernel cannot take tensors of ``device``/``dtype`` under attention dropout ``dropout`` (None: it can)."""
        return kernel_unsupported(self, device, dtype, dropout)


def kernel_unsupported(kernel, device: torch.device, dtype: torch.dtype, dropout: float = 0.0) -> str | None:
    """Why ``kernel`` (its ``devices``, ``dtypes``, ``min_capability``, ``label``, ``has_dropout``) cannot take tensors of
    ``device``/``dtype`` under attention dropout ``dropout`` (None: it can)."""
    if device.type not in kernel.devices:
        return f"tensors on {device.type}, {kernel.label} runs on {'/'.join(kernel.devices)}"
    if dtype not in kernel.dtypes:
        return f"dtype {_dtype_name(dtype)}, {kernel.label} takes {'/'.join(_dtype_name(d) for d in kernel.dtypes)}"
    if dropout > 0 and not kernel.has_dropout:
        return f"attention dropout {dropout:g}, which {kernel.label} has not"
    if device.type == "cuda" and kernel.min_capability is not None:
        capability = torch.cuda.get_device_capability(device)
        if capability < kernel.min_capability:
            return f"GPU compute capability {capability[0]}.{capability[1]} < {kernel.min_capability[0]}.{kernel.min_capability[1]}"
    return None


@dataclass(frozen=True)
class FlashKernel(VarlenKernel):
    """flash-attn's ``flash_attn_varlen_func`` (tests substitute a reference implementation)."""

    label: ClassVar[str] = "flash-attn"


@dataclass(frozen=True)
class FlashOps:
    """torch's own FlashAttention-2 varlen ops, ``aten::_flash_attention_forward`` and ``_flash_attention_backward``
    (the two ``varlen_attn`` calls), as :class:`AtenFlashVarlen` calls them; tests substitute reference
    implementations (the real ones run on CUDA only)."""

    forward: Callable[..., tuple]
    backward: Callable[..., tuple]


# GQA on torch-varlen: K/V heads passed as they are (varlen_attn's enable_gqa, or the aten flash ops), or expanded
GQA_MODES = ("enable_gqa", "aten-flash", "expanded")


@dataclass(frozen=True)
class TorchVarlenKernel(VarlenKernel):
    """torch's ``torch.nn.attention.varlen.varlen_attn`` (tests substitute a reference implementation);
    ``takes_gqa``: it has ``enable_gqa``; ``flash_ops``: torch's aten flash ops where their schema is the one
    :class:`AtenFlashVarlen` calls (None: ``flash_ops_why`` says why not). :attr:`gqa_mode` follows from them."""

    takes_gqa: bool = True
    flash_ops: FlashOps | None = None
    flash_ops_why: str = ""
    label: ClassVar[str] = "varlen_attn"
    has_dropout: ClassVar[bool] = False  # no dropout argument (torch 2.11 .. 2.13)

    @property
    def gqa_mode(self) -> str:
        """How a chunk whose query heads share K/V heads runs (:data:`GQA_MODES`): ``enable_gqa`` (varlen_attn takes
        it), ``aten-flash`` (:class:`AtenFlashVarlen`), else ``expanded`` (:func:`expand_kv_heads`, the last resort)."""
        return "enable_gqa" if self.takes_gqa else "aten-flash" if self.flash_ops is not None else "expanded"

    def gqa_note(self) -> str:
        """The start-up line's words for :attr:`gqa_mode`."""
        if self.gqa_mode == "enable_gqa":
            return "GQA by varlen_attn's enable_gqa, K/V heads not expanded"
        if self.gqa_mode == "aten-flash":
            return "GQA by aten::_flash_attention_forward/backward (varlen_attn has no enable_gqa), K/V heads not expanded"
        return (f"K/V heads expanded for GQA (varlen_attn has no enable_gqa; {self.flash_ops_why}): autograd saves the "
                "expanded K/V, which the memory model does not count")


def _version_tuple(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def load_flash_kernel() -> tuple[FlashKernel | None, str]:
    """``(kernel, "")`` when flash-attn >= 2.1 imports, else ``(None, why not)`` (probed once)."""
    return _probe_flash()


@functools.cache
def _probe_flash() -> tuple[FlashKernel | None, str]:
    try:
        import flash_attn
        from flash_attn import flash_attn_varlen_func
    except Exception as error:  # ImportError, or a wheel built against another torch/CUDA
        return None, f"flash-attn does not import ({type(error).__name__}: {error})"
    version = str(getattr(flash_attn, "__version__", "0"))
    if _version_tuple(version) < FLASH_MIN_VERSION:
        return None, f"flash-attn {version} < 2.1 (its causal mask is top-left aligned, a slice with context needs bottom-right)"
    return FlashKernel(flash_attn_varlen_func, version), ""


TORCH_VARLEN_ARGUMENTS = ("scale", "window_size")  # what the call needs of varlen_attn's signature
NO_FLASH_OPS = (None, "aten flash ops not probed")


def torch_varlen_kernel(varlen_attn: Callable[..., torch.Tensor] | None, torch_version: str,
                        flash_ops: tuple[FlashOps | None, str] = NO_FLASH_OPS, **where) -> tuple[TorchVarlenKernel | None, str]:
    """``(kernel, "")`` for this torch's ``varlen_attn`` (None: it has none), read from its signature:
    ``scale`` and ``window_size`` needed, ``enable_gqa`` used where it has it; else ``(None, why not)``.
    ``flash_ops``: the aten flash ops as :func:`load_aten_flash_ops` gives them (GQA without ``enable_gqa``).
    ``where``: :class:`TorchVarlenKernel`'s ``devices``/``dtypes``/``min_capability`` (tests)."""
    if varlen_attn is None:
        return None, f"torch {torch_version} has no torch.nn.attention.varlen.varlen_attn"
    parameters = inspect.signature(varlen_attn).parameters
    missing = [name for name in TORCH_VARLEN_ARGUMENTS if name not in parameters]
    if missing:
        return None, f"torch {torch_version}'s varlen_attn takes no {'/'.join(missing)}"
    ops, ops_why = flash_ops
    return TorchVarlenKernel(varlen_attn, torch_version, takes_gqa="enable_gqa" in parameters, flash_ops=ops,
                             flash_ops_why=ops_why, **where), ""


def load_torch_varlen() -> tuple[TorchVarlenKernel | None, str]:
    """``(kernel, "")`` when this torch has a usable ``varlen_attn``, else ``(None, why not)`` (probed once)."""
    return _probe_torch_varlen()


@functools.cache
def _probe_torch_varlen() -> tuple[TorchVarlenKernel | None, str]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    return torch_varlen_kernel(varlen_attn, torch.__version__, load_aten_flash_ops())


# What AtenFlashVarlen passes: the positional arguments (query .. return_debug_mask; grad_out .. unused), the
# keywords, and the outputs it reads ((out, lse, rng_state, unused, debug); (dq, dk, dv)), as torch 2.11 and 2.13 have them
FLASH_FORWARD_CALL = (10, ("scale", "window_size_left", "window_size_right"), 5)
FLASH_BACKWARD_CALL = (14, ("scale", "window_size_left", "window_size_right"), 3)


def flash_ops_problem(schema, call: tuple[int, tuple[str, ...], int]) -> str:
    """Why an aten op of ``schema`` (a ``torch._C.FunctionSchema``) cannot be called as :class:`AtenFlashVarlen`
    calls it (``call``: :data:`FLASH_FORWARD_CALL` or :data:`FLASH_BACKWARD_CALL`); "" where it can."""
    positional, keywords, outputs = call
    arguments = schema.arguments
    have = sum(not a.kwarg_only for a in arguments)
    missing = [name for name in keywords if name not in {a.name for a in arguments}]
    if missing:
        return f"{schema.name} takes no {'/'.join(missing)}"
    if have != positional or len(schema.returns) != outputs:
        return f"{schema.name} takes {have} positional arguments and returns {len(schema.returns)} (expected {positional}, {outputs})"
    return ""


def load_aten_flash_ops() -> tuple[FlashOps | None, str]:
    """``(FlashOps, "")`` for this torch's ``aten::_flash_attention_forward``/``_flash_attention_backward`` where their
    schemas are the ones :class:`AtenFlashVarlen` calls, else ``(None, why not)`` (read once; no kernel runs)."""
    return _probe_aten_flash_ops()


@functools.cache
def _probe_aten_flash_ops() -> tuple[FlashOps | None, str]:
    try:
        forward, backward = torch.ops.aten._flash_attention_forward.default, torch.ops.aten._flash_attention_backward.default
    except (AttributeError, RuntimeError) as error:
        return None, f"torch {torch.__version__} has no aten flash ops ({type(error).__name__}: {error})"
    why = flash_ops_problem(forward._schema, FLASH_FORWARD_CALL) or flash_ops_problem(backward._schema, FLASH_BACKWARD_CALL)
    return (None, why) if why else (FlashOps(forward, backward), "")


# megatron-core's AttnBackend names (pretrain_gpt.py's --attention-backend) as requests: None leaves it to the variable
# (fused: Transformer Engine's cuDNN attention, not used with ElasticAttention: auto)
ATTN_BACKEND_REQUESTS = {"auto": None, "fused": None, "flash": "flash", "local": "sdpa", "unfused": "sdpa"}


def requested_backend(attention_backend: str = "auto") -> str:
    """The request: ``attention_backend`` (megatron-core's ``AttnBackend`` name, ``--attention-backend``) where it names
    one, else ``EPP_ATTENTION_BACKEND`` (default ``auto``); an unknown value, or both naming different ones, is an error."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in REQUESTS:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r}: expected one of {', '.join(REQUESTS)}")
    if attention_backend not in ATTN_BACKEND_REQUESTS:
        raise ValueError(f"--attention-backend {attention_backend}: ElasticAttention takes {', '.join(ATTN_BACKEND_REQUESTS)}")
    flag = ATTN_BACKEND_REQUESTS[attention_backend]
    if flag is not None and value not in ("auto", flag):
        raise ValueError(f"--attention-backend {attention_backend} and {ENV}={value} disagree: give one")
    return flag or value


def check_request(request: str) -> None:
    """Fail at build time when ``fa4`` (``flash``, ``varlen``) is requested and flash-attn-4 (flash-attn, torch's
    varlen_attn) is not there."""
    if request == "fa4":
        kernel, why_not = fa4.load_kernel()
        if kernel is None:
            raise AttentionBackendError(f"{ENV}=fa4 but {why_not}; install it (scripts/setup_gpu.sh --wheels DIR) or use {ENV}=auto|sdpa|flash|varlen")
    elif request == "flash":
        kernel, why_not = load_flash_kernel()
        if kernel is None:
            raise AttentionBackendError(f"{ENV}=flash but {why_not}; install flash-attn (scripts/setup_gpu.sh) or use {ENV}=auto|sdpa|varlen")
    elif request == "varlen":
        kernel, why_not = load_torch_varlen()
        if kernel is None:
            raise AttentionBackendError(f"{ENV}=varlen but {why_not}; use {ENV}=auto|sdpa|flash")


def decide(request: str, device: torch.device, dtype: torch.dtype, dropout: float, gqa: bool,
           flash: tuple[FlashKernel | None, str], varlen: tuple[TorchVarlenKernel | None, str],
           cute: tuple[fa4.CuteFlashKernel | None, str] = NO_FA4) -> tuple[str, str]:
    """``(kernel, why)`` for ``request`` on tensors of ``device``/``dtype`` under attention dropout ``dropout``,
    query heads sharing K/V heads or not (``gqa``), given the kernels as probed (``(kernel or None, why not)``
    each, as :func:`load_flash_kernel` and :func:`load_torch_varlen` give them; ``cute``: flash-attn-4 as
    :func:`fa4_state` gives it, its why the probe's note where it passed). Pure: nothing is probed here beyond a
    CUDA device's compute capability (a kernel's ``min_capability``). ``auto`` on CUDA: flash-attn-4, flash-attn,
    torch's varlen_attn, SDPA per segment, the first that runs."""
    cute_kernel, cute_why = cute
    if request == "fa4":
        if cute_kernel is None or cute_kernel.unsupported(device, dtype, dropout):
            why = cute_why if cute_kernel is None else cute_kernel.unsupported(device, dtype, dropout)
            raise AttentionBackendError(f"{ENV}=fa4 but flash-attn-4 cannot run: {why or 'not probed'}")
        return "fa4-varlen", f"flash-attn-4 {cute_kernel.version}, {cute_why}"
    if request == "auto" and cute_kernel is not None and not cute_kernel.unsupported(device, dtype, dropout):
        return "fa4-varlen", f"flash-attn-4 {cute_kernel.version}, one call per chunk, {cute_why}"
    choice, reason = _decide_without_fa4(request, device, dtype, dropout, gqa, flash, varlen)
    if request == "auto" and device.type == "cuda" and (cute_why or cute_kernel is not None):
        why = cute_kernel.unsupported(device, dtype, dropout) if cute_kernel is not None else cute_why
        reason = f"no fa4: {why}; {reason}"
    return choice, reason


def _decide_without_fa4(request: str, device: torch.device, dtype: torch.dtype, dropout: float, gqa: bool,
                        flash: tuple[FlashKernel | None, str], varlen: tuple[TorchVarlenKernel | None, str]) -> tuple[str, str]:
    """:func:`decide` among the kernels before flash-attn-4: flash-attn, torch's varlen_attn, SDPA."""
    flash_kernel, flash_why = flash
    if flash_kernel is not None:
        flash_why = flash_kernel.unsupported(device, dtype, dropout) or ""
    varlen_kernel, varlen_why = varlen
    if varlen_kernel is not None:
        varlen_why = varlen_kernel.unsupported(device, dtype, dropout) or ""
    if device.type == "cuda":
        sdpa, sdpa_why = "sdpa-causal", "SDPA per segment, cuDNN attention excluded (a graph per new shape)"
    elif device.type == "cpu":
        sdpa, sdpa_why = "sdpa-merged", ""
        if dropout > 0:
            sdpa, sdpa_why = "sdpa-masked", "masked: attention dropout, which the CPU flash kernel has not"
    else:
        sdpa, sdpa_why = "sdpa-masked", ""
    if request == "flash":
        if flash_why:
            raise AttentionBackendError(f"{ENV}=flash but flash-attn cannot run: {flash_why}")
        return "flash-varlen", f"flash-attn {flash_kernel.version}"
    varlen_reason = "" if varlen_why else f"torch {varlen_kernel.version} varlen_attn, one call per chunk" + (
        f", {varlen_kernel.gqa_note()}" if gqa else "")
    if request == "varlen":
        if varlen_why:
            raise AttentionBackendError(f"{ENV}=varlen but torch's varlen_attn cannot run: {varlen_why}")
        return "torch-varlen", varlen_reason
    if request == "sdpa":
        return sdpa, "; ".join(filter(None, ["varlen kernels not requested", sdpa_why]))
    if not flash_why:
        return "flash-varlen", f"flash-attn {flash_kernel.version}"
    if not varlen_why:
        return "torch-varlen", f"no flash: {flash_why}; {varlen_reason}"
    return sdpa, "; ".join(filter(None, [f"no flash: {flash_why}", f"no torch varlen: {varlen_why}", sdpa_why]))


def fa4_state(request: str, device: torch.device, dtype: torch.dtype, dropout: float,
              heads: tuple[int, int, int] | None, deterministic: bool = False) -> tuple[fa4.CuteFlashKernel | None, str]:
    """flash-attn-4 for :func:`decide`: ``(kernel, the probe's note)`` where it imports, can take the tensors and passes
    :func:`fa4.probe` for the head shape ``heads`` (query heads, K/V heads, head dim per rank: the probe compiles the
    run's kernel variants), else ``(None, why not)``; :data:`NO_FA4` where it is not a candidate (another request; not
    on CUDA, where tests substitute a kernel that runs on the CPU)."""
    if request not in ("auto", "fa4"):
        return NO_FA4
    kernel, why = fa4.load_kernel()
    if kernel is None:
        return (None, why) if device.type == "cuda" or request == "fa4" else NO_FA4
    unsupported = kernel.unsupported(device, dtype, dropout)
    if unsupported:
        return None, unsupported
    if heads is None:
        return None, "flash-attn-4 not probed: no head shape given"
    result = fa4.probe(kernel, device, dtype, *heads, deterministic=deterministic)
    return (None, f"flash-attn-4 {kernel.version}: {result.why}") if result.why else (kernel, result.note())


def select_backend(request: str, device: torch.device, dtype: torch.dtype,
                   decided: dict[tuple[str, str, torch.dtype, bool, bool], str] | None = None, dropout: float = 0.0,
                   gqa: bool = False, heads: tuple[int, int, int] | None = None, deterministic: bool = False) -> str:
    """``fa4-varlen``, ``flash-varlen``, ``torch-varlen``, ``sdpa-causal``, ``sdpa-merged`` or ``sdpa-masked``
    (:func:`decide`) for tensors of ``device``/``dtype`` under attention dropout ``dropout`` (0 in evaluation), with
    or without GQA, printed (first rank only) with its reason. ``heads``: (query heads, K/V heads, head dim) of a
    layer on this rank, which flash-attn-4's probe runs (and so compiles) before it is chosen.

    ``decided``: the caller's record of earlier decisions (a model's :class:`ChunkContext` keeps one, so
    each (request, device type, dtype, with or without dropout, with or without GQA) is decided and printed
    once per model); None: decide now.
    """
    key = (request, device.type, dtype, dropout > 0, gqa)
    if decided is not None and key in decided:
        return decided[key]
    cute = fa4_state(request, device, dtype, dropout, heads, deterministic)
    choice, reason = decide(request, device, dtype, dropout, gqa, load_flash_kernel(), load_torch_varlen(), cute)
    if decided is not None:
        decided[key] = choice
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or torch.distributed.get_rank() == 0:
        with_dropout = f", attention dropout {dropout:g}" if dropout > 0 else ""
        print(f"> elastic attention: {choice} ({ENV}={request}, {device.type} {_dtype_name(dtype)}{with_dropout}; {reason})", flush=True)
    return choice


def reset_flash_probe() -> None:
    """Forget the flash-attn, varlen_attn and aten flash op probes (tests that swap the installed flash-attn)."""
    _probe_flash.cache_clear()
    _probe_torch_varlen.cache_clear()
    _probe_aten_flash_ops.cache_clear()
    fa4.reset()


def segment_attention(q, k, v, mask: torch.Tensor | None, dropout: float = 0.0, scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """One segment's attention, [s, b, heads, d] in and out, under a bottom-right causal ``mask``
    (or, with ``mask=None, causal=True``, SDPA's own causal mask: the same when keys = queries).
    ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention: query head ``i`` reads K/V
    head ``i // (heads / kv_heads)``), passed to SDPA as they are (``enable_gqa``)."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None, scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],  # grouped-query attention: the K/V heads are shared, never repeated
    )
    return out.permute(2, 0, 1, 3)


def _segments(query, key, value, view: ChunkView, slice_kv):
    """Each segment's ``(index, q, k, v)``; the slice's K/V are ``slice_kv`` (its buffer's rows, in place)."""
    for index, (start, end) in enumerate(view.bounds):
        k, v = slice_kv if index == view.split_index else (key[start:end], value[start:end])
        yield index, query[start:end], k, v


def sdpa_masked(query, key, value, view: ChunkView, slice_kv, dropout: float, scale: float) -> torch.Tensor:
    """Every segment one SDPA under its explicit bottom-right causal mask (CPU with dropout; other devices), never on cuDNN."""
    with sdpa_kernel(list(SDPA_BACKENDS)):
        outputs = [segment_attention(q, k, v, view.masks[i], dropout, scale) for i, q, k, v in _segments(query, key, value, view, slice_kv)]
    return torch.cat(outputs)


def _causal_segments(query, key, value, view: ChunkView, slice_kv, dropout: float, scale: float,
                     with_prefix: Callable[..., torch.Tensor]) -> torch.Tensor:
    """SDPA's ``is_causal`` for every segment without context; ``with_prefix(q, k, v)`` for the slice with it."""
    outputs = []
    for _, q, k, v in _segments(query, key, value, view, slice_kv):
        causal = k.shape[0] == q.shape[0]
        outputs.append(segment_attention(q, k, v, None, dropout, scale, causal=True) if causal else with_prefix(q, k, v))
    return torch.cat(outputs)


@functools.cache
def _causal_bias_takes_gqa() -> bool:
    return "enable_gqa" in inspect.signature(CausalBias._dispatch).parameters


def lower_right_attention(q, k, v, dropout: float, scale: float) -> torch.Tensor:
    """One slice's attention over its ``C`` prefix and its own ``s`` keys, [s, b, heads, d] in and out,
    under torch's ``causal_lower_right(s, C + s)`` bias (no mask built where SDPA's kernels take it); under
    the explicit mask where this torch's ``CausalBias`` takes no ``enable_gqa`` (SDPA hands its arguments on)."""
    s, keys = q.shape[0], k.shape[0]
    if not _causal_bias_takes_gqa():  # SDPA passes its enable_gqa on to the bias, which would refuse it
        return segment_attention(q, k, v, bottom_right_causal_mask(s, keys - s, q.device), dropout, scale)
    return segment_attention(q, k, v, causal_lower_right(s, keys), dropout, scale)


def sdpa_causal(query, key, value, view: ChunkView, slice_kv, dropout: float, scale: float) -> torch.Tensor:
    """SDPA's ``is_causal`` for segments without context, ``causal_lower_right`` for the slice with prefix;
    on SDPA's flash, memory-efficient or math kernel, never cuDNN attention (``SDPA_BACKENDS``)."""
    with sdpa_kernel(list(SDPA_BACKENDS)):
        return _causal_segments(query, key, value, view, slice_kv, dropout, scale,
                                lambda q, k, v: lower_right_attention(q, k, v, dropout, scale))


class PrefixMergedAttention(torch.autograd.Function):
    """Attention of a slice's ``s`` queries over its ``C`` prefix keys (all visible) and its own ``s``
    keys (causal), ``[b, heads, s, d]`` queries and ``[b, kv_heads, C + s, d]`` keys/values (views of the
    sequence's K/V buffer, read in place), with the CPU flash kernel and no mask.

    The prefix goes block by block (``blocks``: the sequence's earlier slices, ``ChunkView.prefix_blocks``), then the
    own keys (``is_causal``, which is the bottom-right mask once the prefix is apart): :func:`merged_forward`, the
    parts merged by their log-sum-exp; a sequence whose K/V buffer is on the host runs the same arithmetic over its
    device window (``attention._HostSliceAttention``), so the two give the same bits. Backward: the kernel's backward
    of each part given the merged ``o`` and ``l`` (its ``P = exp(S - l)`` and ``D = rowsum(dO o)`` are then those of
    the whole attention), the query gradients summed in order, the key/value gradients the parts' rows. Saves what
    SDPA's flash kernel saves: q, k, v (views), the output and the fp32 log-sum-exp.
    """

    @staticmethod
    def forward(ctx, q, k, v, blocks: tuple[tuple[int, int], ...], scale: float):
        out, lse = merged_forward(q, _buffer_parts(k, v, blocks), scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dk, dv = [], []

        def take(i, grad_key, grad_value):
            dk.append(grad_key)
            dv.append(grad_value)

        dq = merged_backward(grad_out.contiguous(), q, out, lse, _buffer_parts(k, v, ctx.blocks), ctx.scale, take)
        return dq, torch.cat(dk, dim=2), torch.cat(dv, dim=2), None, None


def _buffer_parts(k, v, blocks: tuple[tuple[int, int], ...]):
    """``(k, v, causal)`` per prefix block of the buffer's rows, then the own rows (causal)."""
    for a, b in blocks:
        yield k[:, :, a:b], v[:, :, a:b], False
    context = blocks[-1][1] if blocks else 0
    yield k[:, :, context:], v[:, :, context:], True


def block_attention(q, k, v, causal: bool, scale: float, kernel: "BlockFlashKernel | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q`` ``[b, heads, s, d]`` over one block of keys ``[b, kv_heads, rows, d]`` (``causal``:
    rows = s, lower triangle): ``kernel`` (:class:`BlockFlashKernel`, CUDA) where given, else the CPU flash kernel
    (GQA native either way); ``lse`` ``[b, heads, s]`` fp32."""
    if kernel is not None:
        return kernel.forward(q, k, v, causal, scale)
    if q.device.type != "cpu":
        raise NotImplementedError(f"block attention on {q.device.type} without a block kernel (block_kernel gives the CUDA one)")
    out, lse = _cpu_flash(q, k, v, 0.0, causal, scale=scale)[:2]
    return out, lse


def merged_forward(q, parts, scale: float, kernel: "BlockFlashKernel | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q`` over ``parts`` (``(k, v, causal)`` blocks, in order), merged by their log-sum-exp one
    after the other (fp32 while more than one; ``out`` in ``q``'s dtype); each block by :func:`block_attention`."""
    acc = None
    for k, v, causal in parts:
        o, lse = block_attention(q, k, v, causal, scale, kernel)
        if acc is None:
            acc = (o, lse)
            continue
        o0, l0 = acc
        merged = torch.logaddexp(l0, lse)
        acc = (torch.exp(l0 - merged).unsqueeze(-1) * o0 + torch.exp(lse - merged).unsqueeze(-1) * o, merged)
    return acc[0].to(q.dtype), acc[1]


def merged_backward(grad_out, q, out, lse, parts, scale: float, take: Callable[[int, torch.Tensor, torch.Tensor], None],
                    kernel: "BlockFlashKernel | None" = None) -> torch.Tensor:
    """The query gradient of :func:`merged_forward` (summed over the parts in order); each part's key and value
    gradients go to ``take(i, dk, dv)`` as they come. Each part's backward is given the MERGED ``out`` and ``lse``
    (FlashAttention's backward identity: its ``P = exp(S - lse)`` and ``D = rowsum(dO out)`` are then the whole
    attention's): the CPU flash kernel's, or ``kernel``'s (:meth:`BlockFlashKernel.backward`)."""
    if kernel is not None:
        packed = kernel.pack_merged(grad_out, q, out, lse)
    dq = None
    for i, (k, v, causal) in enumerate(parts):
        if kernel is not None:
            dq_i, dk, dv = kernel.backward(packed, k, v, causal, scale)
        else:
            dq_i, dk, dv = _cpu_flash_backward(grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
        take(i, dk, dv)
        dq = dq_i if dq is None else dq + dq_i
    return dq


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """``[b, heads, s, d]`` as the varlen layout ``[b * s, heads, d]`` (a view where ``t`` is one sequence's rows in place)."""
    b, heads, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, heads, d)


def _untokens(t: torch.Tensor, b: int) -> torch.Tensor:
    """The varlen layout ``[b * s, heads, d]`` back as ``[b, heads, s, d]`` (a view)."""
    return t.view(b, t.shape[0] // b, *t.shape[1:]).transpose(1, 2)


def _cu_seqlens(b: int, rows: int, device) -> torch.Tensor:
    """``cu_seqlens`` of ``b`` sequences of ``rows`` rows each (int32)."""
    return torch.arange(0, (b + 1) * rows, rows, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class BlockFlashKernel:
    """One block of a slice's attention (K/V buffers on the host, ``executor.kv_host``) on CUDA: torch's aten flash ops
    (``ops``, :class:`FlashOps`), each of the ``b`` rows one sequence of the varlen call (``[b, heads, s, d]`` to
    ``[b * s, heads, d]``, ``cu_seqlens`` of ``s`` and of the block's rows), non-causal over a prefix block (window
    ``(-1, -1)``), causal over the own block (``(-1, 0)``), no dropout, K/V heads as they are (GQA native). ``lse``
    ``[b, heads, s]`` fp32 as the CPU flash kernel's (the ops' ``[heads, b * s]``). ``devices``/``dtypes``/
    ``min_capability``: where it runs (tests: the reference ops on CPU in fp32)."""

    ops: FlashOps
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    min_capability: tuple[int, int] | None = (8, 0)
    label: ClassVar[str] = "the block kernel (aten flash ops)"
    has_dropout: ClassVar[bool] = False

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return kernel_unsupported(self, device, dtype)

    @staticmethod
    def _window(causal: bool) -> dict:
        return {"window_size_left": -1, "window_size_right": 0 if causal else -1}

    def forward(self, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [b, heads, s, d], lse [b, heads, s])`` of ``q`` over the block ``k``/``v`` ``[b, kv_heads, rows, d]``."""
        b, heads, s, _ = q.shape
        rows = k.shape[2]
        out, lse, _, _, _ = self.ops.forward(
            _tokens(q), _tokens(k), _tokens(v), _cu_seqlens(b, s, q.device), _cu_seqlens(b, rows, q.device), s, rows,
            0.0, causal, False, scale=scale, **self._window(causal),
        )
        return _untokens(out, b), lse.view(heads, b, s).transpose(0, 1)

    def pack_merged(self, grad_out, q, out, lse) -> tuple:
        """What every block's backward takes of the merged attention, in the ops' layout (once per slice)."""
        b, heads, s, _ = q.shape
        lse_tokens = lse.transpose(0, 1).reshape(heads, b * s).contiguous()
        return b, s, _tokens(grad_out).contiguous(), _tokens(q), _tokens(out).contiguous(), lse_tokens

    def backward(self, packed: tuple, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq [b, heads, s, d], dk, dv [b, kv_heads, rows, d])`` of one block given the merged attention
        (``packed``: :meth:`pack_merged`), the rng state zeros (no dropout) as ``varlen_attn``'s backward passes it."""
        b, s, grad_out, q, out, lse = packed
        rows = k.shape[2]
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = self.ops.backward(
            grad_out, q, _tokens(k), _tokens(v), out, lse, _cu_seqlens(b, s, q.device), _cu_seqlens(b, rows, q.device), s,
            rows, 0.0, causal, rng_state, unused, scale=scale, **self._window(causal),
        )
        return _untokens(dq, b), _untokens(dk, b), _untokens(dv, b)


def load_block_flash() -> tuple[BlockFlashKernel | None, str]:
    """``(BlockFlashKernel, "")`` over this torch's aten flash ops (:func:`load_aten_flash_ops`), else ``(None, why not)``."""
    ops, why = load_aten_flash_ops()
    return (BlockFlashKernel(ops), "") if ops is not None else (None, why)


def block_kernel_problem(device: torch.device, dtype: torch.dtype) -> str:
    """Why a slice's block attention over its host K/V cannot run on ``device``/``dtype`` ("" where it can: CPU, or
    a block kernel of :func:`load_block_flash` that takes them)."""
    kernel, why = load_block_flash()
    if (kernel is not None and kernel.unsupported(device, dtype) is None) or device.type == "cpu":
        return ""
    return why or kernel.unsupported(device, dtype)


def block_kernel(device: torch.device, dtype: torch.dtype) -> BlockFlashKernel | None:
    """The block kernel for tensors of ``device``/``dtype``: :func:`load_block_flash`'s where it takes them, else None
    on CPU (the CPU flash kernel, bit for bit the device buffer's ``sdpa-merged``); elsewhere one line."""
    kernel, _ = load_block_flash()
    if kernel is not None and kernel.unsupported(device, dtype) is None:
        return kernel
    problem = block_kernel_problem(device, dtype)
    if problem:
        raise AttentionBackendError(f"K/V buffers on the host (kv_host) on {device.type}: the block attention cannot run ({problem})")
    return None


def _cpu_flash(*args, **kwargs):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, **kwargs)


def _cpu_flash_backward(*args, **kwargs):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, **kwargs)


def prefix_merged_attention(q, k, v, scale: float, blocks: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
    """:class:`PrefixMergedAttention` of one slice, [s, b, heads, d] in and out (``k``/``v`` ``[C + s, b,
    kv_heads, d]``: its prefix, then its own rows; grouped-query attention native); ``blocks``: the prefix's
    blocks (None: the whole prefix as one)."""
    context = k.shape[0] - q.shape[0]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    return PrefixMergedAttention.apply(q, k, v, blocks or ((0, context),), scale).permute(2, 0, 1, 3)


def sdpa_merged(query, key, value, view: ChunkView, slice_kv, dropout: float, scale: float) -> torch.Tensor:
    """CPU: ``is_causal`` SDPA for segments without context, :func:`prefix_merged_attention` for the slice
    with prefix (its blocks: ``view.prefix_blocks``); no mask anywhere. No attention dropout (:func:`select_backend` takes ``sdpa-masked`` for it)."""
    if dropout > 0:
        raise ValueError("sdpa-merged has no attention dropout (the CPU flash kernel has none): select_backend takes sdpa-masked")
    return _causal_segments(query, key, value, view, slice_kv, 0.0, scale,
                            lambda q, k, v: prefix_merged_attention(q, k, v, scale, view.prefix_blocks))


def pack_kv(own: torch.Tensor, slice_rows: torch.Tensor, view: ChunkView) -> torch.Tensor:
    """The chunk's keys (or values) ``[N + C, heads, d]``: ``slice_rows`` (the slice's prefix and own
    rows, from its buffer) in place of the slice's own tokens; a chunk that is only the slice has
    exactly those rows, uncopied."""
    if len(view.bounds) == 1:
        return slice_rows
    start, end = view.bounds[view.split_index]
    return torch.cat([own[:start], slice_rows, own[end:]])


def _packed_chunk(query, key, value, view: ChunkView, slice_kv, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A varlen kernel's ``q`` ``[N, heads, d]`` and ``k``/``v`` ``[N + C, kv_heads, d]`` (:func:`pack_kv`)."""
    if query.shape[1] != 1:
        raise ValueError(f"{backend} packs one sequence row per chunk; got micro-batch {query.shape[1]}")
    q, k, v = query[:, 0], key[:, 0], value[:, 0]
    if slice_kv is not None:
        k, v = pack_kv(k, slice_kv[0][:, 0], view), pack_kv(v, slice_kv[1][:, 0], view)
    return q, k, v


def flash_varlen(query, key, value, view: ChunkView, slice_kv, dropout: float, scale: float, deterministic: bool = False) -> torch.Tensor:
    """The whole chunk in one ``flash_attn_varlen_func`` call; [N, 1, heads, d] in and out."""
    kernel, why_not = load_flash_kernel()
    if kernel is None:
        raise AttentionBackendError(why_not)
    q, k, v = _packed_chunk(query, key, value, view, slice_kv, "flash-varlen")
    meta = view.varlen
    out = kernel.varlen_func(
        q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
        dropout_p=dropout, softmax_scale=scale, causal=True, deterministic=deterministic,
    )
    return out.unsqueeze(1)


def expand_kv_heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """``kv`` ``[T, kv_heads, d]`` with each K/V head repeated for the query heads that share it: ``[T, heads, d]``,
    query head ``i`` reading K/V head ``i // (heads / kv_heads)`` (megatron-core's grouping)."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1)


class AtenFlashVarlen(torch.autograd.Function):
    """One chunk's attention through torch's FlashAttention-2 varlen ops (``ops``: :class:`FlashOps`), the K/V heads
    as they are (``q`` ``[N, heads, d]``, ``k``/``v`` ``[N + C, kv_heads, d]``, ``heads % kv_heads == 0``): what
    ``varlen_attn(..., window_size=(-1, 0), enable_gqa=True)`` does on torch 2.13, for a torch whose ``varlen_attn``
    has no ``enable_gqa`` (2.11). Causal, bottom-right aligned, no dropout. Forward saves what torch's own varlen
    autograd saves: q, k, v (K/V at ``kv_heads`` width, views of the K/V buffer where they are), the output, the
    fp32 log-sum-exp and the rng state (zeros, as torch's own: no dropout), and its backward passes the aten
    backward what torch's own ``_varlen_attn_backward`` passes; it returns ``dk``/``dv`` at ``kv_heads`` width."""

    @staticmethod
    def forward(ctx, q, k, v, seqlens, scale: float, ops: FlashOps):
        out, lse, _, _, _ = ops.forward(
            q, k, v, seqlens.cu_seqlens_q, seqlens.cu_seqlens_k, seqlens.max_seqlen_q, seqlens.max_seqlen_k, 0.0, True, False,
            scale=scale, window_size_left=-1, window_size_right=0,
        )
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # as torch's varlen_attn keeps it: no dropout, no state
        ctx.save_for_backward(q, k, v, out, lse, rng_state)
        ctx.seqlens, ctx.scale, ctx.ops = seqlens, scale, ops
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, rng_state = ctx.saved_tensors
        seqlens = ctx.seqlens
        unused = torch.empty(0, device=q.device)  # as varlen_attn's own backward passes it
        dq, dk, dv = ctx.ops.backward(
            grad_out.contiguous(), q, k, v, out, lse, seqlens.cu_seqlens_q, seqlens.cu_seqlens_k, seqlens.max_seqlen_q,
            seqlens.max_seqlen_k, 0.0, True, rng_state, unused, scale=ctx.scale, window_size_left=-1, window_size_right=0,
        )
        return dq, dk, dv, None, None, None


def torch_varlen(query, key, value, view: ChunkView, slice_kv, dropout: float, scale: float) -> torch.Tensor:
    """The whole chunk in one call of torch's ``varlen_attn`` (bottom-right causal: ``window_size=(-1, 0)``);
    [N, 1, heads, d] in and out. GQA as :attr:`TorchVarlenKernel.gqa_mode` says: ``enable_gqa``, else
    :class:`AtenFlashVarlen` (K/V heads not expanded either), else expanded K/V heads."""
    if dropout > 0:
        raise ValueError("torch-varlen has no attention dropout (varlen_attn takes none): select_backend takes another kernel")
    kernel, why_not = load_torch_varlen()
    if kernel is None:
        raise AttentionBackendError(why_not)
    q, k, v = _packed_chunk(query, key, value, view, slice_kv, "torch-varlen")
    heads, gqa = q.shape[1], {}
    meta = view.varlen
    if k.shape[1] != heads:
        if kernel.gqa_mode == "aten-flash":
            return AtenFlashVarlen.apply(q, k, v, meta, scale, kernel.flash_ops).unsqueeze(1)
        if kernel.gqa_mode == "enable_gqa":
            gqa = {"enable_gqa": True}
        else:
            k, v = expand_kv_heads(k, heads), expand_kv_heads(v, heads)
    out = kernel.varlen_func(
        q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
        scale=scale, window_size=(-1, 0), **gqa,
    )
    return out.unsqueeze(1)


def fa4_varlen(query, key, value, view: ChunkView, slice_kv, dropout: float, scale: float, deterministic: bool = False) -> torch.Tensor:
    """The whole chunk in one call of flash-attn-4's ``flash_attn_varlen_func`` (:class:`fa4.CuteFlashKernel`: causal,
    bottom-right aligned, GQA packed, K/V heads never expanded); [N, 1, heads, d] in and out."""
    if dropout > 0:
        raise ValueError("fa4-varlen has no attention dropout (flash-attn-4 takes none): select_backend takes another kernel")
    kernel, why_not = fa4.load_kernel()
    if kernel is None:
        raise AttentionBackendError(why_not)
    q, k, v = _packed_chunk(query, key, value, view, slice_kv, "fa4-varlen")
    return kernel.attend(q, k, v, view.varlen, scale, deterministic).unsqueeze(1)


BACKENDS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa-masked": sdpa_masked, "sdpa-merged": sdpa_merged, "sdpa-causal": sdpa_causal, "fa4-varlen": fa4_varlen,
    "flash-varlen": flash_varlen, "torch-varlen": torch_varlen,
}
DETERMINISTIC_BACKENDS = ("fa4-varlen", "flash-varlen")  # the kernels with a deterministic backward option
