"""Fused pointwise kernels of a layer and the output head, and the one decision of which runs (:func:`decide`).

Four ops, each run by one of four backends: ``norm`` (RMSNorm), ``swiglu`` (SiLU(gate) x up of the MLP's fc1 output,
gate in the first half: megatron-core's layout), ``rope`` (the elastic chunk's rotation of query and key, at each
token's position in its document) and ``cross_entropy`` (the output head's loss over the logits). Backends: ``torch``
(today's unfused modules, exactly), ``compile`` (``torch.compile(dynamic=True)`` of the op's pointwise function: one
graph for every chunk length), ``liger`` (liger-kernel's Triton kernels) and ``quack`` (quack-kernels' CuTe DSL
kernels, sm90 and newer). The libraries are adapted here (:class:`KernelLibrary`, built by :func:`liger_library` and
:func:`quack_library` from the modules they import), so tests substitute fake modules written in torch.

What decides is :func:`decide`, a pure function of the request (``EPP_FUSED_KERNELS``, :func:`parse_request`),
Megatron-LM's flags (:class:`FusedFlags`), the device type, capability and dtype, and the libraries as probed
(``(library or None, why not)`` each). On the CPU the default is ``torch`` for every op (today's path); on CUDA each
op takes the first of :data:`AUTO_ORDER` that can run, unless its Megatron-LM flag turns it off. docs/gpu.md
("Fused pointwise kernels") says what each flag means here.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F

ENV = "EPP_FUSED_KERNELS"
OPS = ("norm", "swiglu", "rope", "cross_entropy")
BACKENDS = ("torch", "compile", "liger", "quack")
LIBRARIES = ("liger", "quack")
# On CUDA, "auto" takes the first that runs. Provisional (not measured yet): the lead's benchmarks/fused_kernels.py
# run on the GPU decides the order; compile last of the fused ones (a graph per op and dtype, built at the first step).
AUTO_ORDER = ("liger", "quack", "compile")
LABELS = {"norm": "norm", "swiglu": "swiglu", "rope": "rope", "cross_entropy": "cross-entropy"}


class FusedKernelError(RuntimeError):
    """A requested fused kernel cannot run here."""


@dataclass(frozen=True)
class FusedFlags:
    """What Megatron-LM's flags and the model say of each op. ``rope_fusion`` (``--no-rope-fusion`` turns it off),
    ``bias_swiglu_fusion`` (``--no-bias-swiglu-fusion``), ``cross_entropy_loss_fusion`` (``--cross-entropy-loss-fusion``
    turns it on); ``rms_norm``/``swiglu``/``rope``: the model has the op (``--normalization RMSNorm``, ``--swiglu``,
    RoPE with ``--elastic-pp``: the elastic chunk's rotation is the one fused); ``tp``: the tensor-parallel size (the
    libraries' cross entropy is not vocab-parallel)."""

    rope_fusion: bool = True
    bias_swiglu_fusion: bool = True
    cross_entropy_loss_fusion: bool = False
    rms_norm: bool = True
    swiglu: bool = True
    rope: bool = True
    tp: int = 1

    def off(self, op: str) -> str:
        """Why ``op`` is not fused whatever is requested ("" where it may be)."""
        absent = {"norm": (not self.rms_norm, "LayerNorm (the fused norms are RMSNorm's)"),
                  "swiglu": (not self.swiglu, "no SwiGLU MLP"), "rope": (not self.rope, "no elastic RoPE"),
                  "cross_entropy": (False, "")}[op]
        if absent[0]:
            return absent[1]
        flag = {"norm": (True, ""), "swiglu": (self.bias_swiglu_fusion, "--no-bias-swiglu-fusion"),
                "rope": (self.rope_fusion, "--no-rope-fusion"),
                "cross_entropy": (self.cross_entropy_loss_fusion, "no --cross-entropy-loss-fusion")}[op]
        return "" if flag[0] else flag[1]


@dataclass(frozen=True)
class KernelLibrary:
    """A kernel library's ops in this module's calling convention (None: it has not that op), where it runs and why
    it may not run an op (``refuses``: op -> reason)."""

    name: str
    version: str
    ops: dict[str, Callable | None]
    devices: tuple[str, ...] = ("cuda",)
    min_capability: tuple[int, int] = (8, 0)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

    def unsupported(self, op: str, device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None, tp: int) -> str:
        """Why this library cannot run ``op`` here ("" where it can)."""
        if self.ops.get(op) is None:
            return f"{self.name} {self.version} has no {LABELS[op]} kernel here"
        if device_type not in self.devices:
            return f"tensors on {device_type}, {self.name} runs on {'/'.join(self.devices)}"
        if dtype not in self.dtypes:
            return f"{self.name} takes no {str(dtype).removeprefix('torch.')}"
        if capability is not None and capability < self.min_capability:
            return f"{self.name} needs compute capability {self.min_capability[0]}.{self.min_capability[1]}"
        if op == "cross_entropy" and tp > 1:
            return f"{self.name}'s cross entropy is not vocab-parallel (TP {tp})"
        return ""


@dataclass(frozen=True)
class FusedChoice:
    """The backend of each op (:data:`BACKENDS`) and why, one decision per run (:func:`decide`)."""

    norm: str = "torch"
    swiglu: str = "torch"
    rope: str = "torch"
    cross_entropy: str = "torch"
    why: tuple[str, ...] = field(default=(), compare=False)

    def of(self, op: str) -> str:
        return getattr(self, op)

    def fused(self) -> bool:
        return any(self.of(op) != "torch" for op in OPS)

    def tag(self) -> str:
        """What enters a measured profile's key: "" when nothing is fused (keys of profiles measured before stay
        valid), else ``fused:norm=liger;swiglu=liger;rope=torch;ce=torch`` (no comma nor parenthesis: the key is
        read back from the profile's device name)."""
        if not self.fused():
            return ""
        return "fused:" + ";".join(f"{'ce' if op == 'cross_entropy' else op}={self.of(op)}" for op in OPS)

    def line(self) -> str:
        """The start-up line."""
        ops = ", ".join(f"{LABELS[op]}={self.of(op)}" for op in OPS)
        return f"> fused kernels: {ops} ({'; '.join(self.why) or 'nothing to fuse'})"


UNFUSED = FusedChoice()


def parse_request(text: str | None) -> dict[str, str]:
    """``EPP_FUSED_KERNELS``'s value as op -> request: ``auto`` (default), one backend for every op (written
    ``all:BACKEND``: an op whose Megatron-LM flag turns it off then stays unfused), or ``op=backend`` pairs separated
    by commas (``norm=liger,rope=compile``; the ops not named: ``auto``; an op named whose flag is off: an error)."""
    value = (text or "").strip().lower() or "auto"
    requests = ("auto", *BACKENDS)
    if value in requests:  # one backend for all: an op its flag turns off stays unfused (marked "all:")
        return {op: value if value == "auto" else "all:" + value for op in OPS}
    out = dict.fromkeys(OPS, "auto")
    for pair in value.split(","):
        op, _, backend = (part.strip() for part in pair.partition("="))
        op = "cross_entropy" if op in ("ce", "cross-entropy") else op
        if op not in OPS or backend not in requests:
            raise ValueError(f"{ENV}={text!r}: expected auto, one of {', '.join(BACKENDS)}, or op=backend pairs "
                             f"(ops {', '.join(OPS)}) separated by commas")
        out[op] = backend
    return out


def requested() -> dict[str, str]:
    """The request of the environment (:func:`parse_request` of ``EPP_FUSED_KERNELS``)."""
    return parse_request(os.environ.get(ENV))


def _backend_why(backend: str, op: str, where: tuple, libraries: dict, compiler: tuple) -> str:
    """Why ``backend`` cannot run ``op`` at ``where`` = (device type, dtype, capability, tp) ("" where it can)."""
    device_type, dtype, capability, tp = where
    if backend == "torch":
        return ""
    if backend == "compile":  # at TP > 1 the cross entropy is megatron-core's fused vocab-parallel one (its torch.compile)
        return "" if compiler[0] is not None else compiler[1]
    library, why = libraries.get(backend, (None, f"{backend} not probed"))
    return why if library is None else library.unsupported(op, device_type, dtype, capability, tp)


def _decide_op(op: str, request: str, flags: FusedFlags, where: tuple, libraries: dict, compiler: tuple) -> tuple[str, str]:
    """One op's ``(backend, why)`` (:func:`decide`)."""
    off = flags.off(op)
    if off:
        if request not in ("auto", "torch") and not request.startswith("all:"):
            raise FusedKernelError(f"{ENV} asks {LABELS[op]}={request}, but {off}: give one")
        return "torch", f"{LABELS[op]}: {off}"
    request = request.removeprefix("all:")
    if request == "torch":
        return "torch", ""
    if request != "auto":
        why = _backend_why(request, op, where, libraries, compiler)
        if why:
            raise FusedKernelError(f"{ENV} asks {LABELS[op]}={request}, which cannot run: {why}")
        return request, ""
    if where[0] != "cuda":
        return "torch", ""
    reasons = []
    for backend in AUTO_ORDER:
        why = _backend_why(backend, op, where, libraries, compiler)
        if not why:
            return backend, ""
        reasons.append(f"no {backend}: {why}")
    return "torch", f"{LABELS[op]}: {'; '.join(reasons)}"


def decide(request: dict[str, str], flags: FusedFlags, device_type: str, dtype: torch.dtype,
           libraries: dict[str, tuple[KernelLibrary | None, str]], compiler: tuple[object | None, str] = (True, ""),
           capability: tuple[int, int] | None = None) -> FusedChoice:
    """Each op's backend for ``request`` (:func:`parse_request`), given Megatron-LM's ``flags``, tensors of ``device_type``/``dtype``
    (``capability``: the GPU's), the libraries as probed (``{"liger": (library or None, why not), "quack": ...}``)
    and torch.compile as probed (``compiler``: ``(anything or None, why not)``). Pure: nothing is probed here.

    On a device other than CUDA ``auto`` is ``torch`` (today's modules); on CUDA the first of :data:`AUTO_ORDER`
    that runs. A backend asked by name that cannot run, or asked for an op its flag turns off, is a
    :class:`FusedKernelError` (one line)."""
    where = (device_type, dtype, capability, flags.tp)
    chosen, reasons = {}, []
    for op in OPS:
        chosen[op], why = _decide_op(op, request[op], flags, where, libraries, compiler)
        if why:
            reasons.append(why)
    if device_type != "cuda" and all(request[op] == "auto" for op in OPS):
        reasons.insert(0, f"{device_type}: today's unfused modules ({ENV}=auto)")
    elif all(value == "torch" for value in chosen.values()) and not reasons:
        reasons.append(f"{ENV} asks torch")
    return FusedChoice(**chosen, why=tuple(reasons))



# --- the ops in one calling convention: norm(x, weight, eps, offset), swiglu(y), rope(query, key, cos, sin) with
# query/key [s, b, heads, d] and cos/sin [s, 1, 1, rotary_dim] (plain sine, megatron-core's duplicated halves) in the
# activations' dtype, cross_entropy(logits [s, b, V], labels [s, b]) -> fp32 losses [s, b] (TP = 1)

def reference_norm(x, weight, eps: float, offset: float = 0.0):
    """torch's RMSNorm (what ``torch.nn.RMSNorm`` and :class:`ZeroCenteredRMSNorm` compute)."""
    return F.rms_norm(x, (x.shape[-1],), weight + offset if offset else weight, eps)


def reference_swiglu(y):
    """megatron-core's unfused gated SiLU: ``silu(gate) * up``, gate the first half of fc1's output."""
    gate, up = torch.chunk(y, 2, dim=-1)
    return F.silu(gate) * up


def _rotate_half_rope(t, cos, sin):
    """megatron-core's ``t cos + rotate_half(t) sin`` on the first ``rotary_dim`` channels, the rest passed on."""
    rotary_dim = cos.shape[-1]
    rot, rest = t[..., :rotary_dim], t[..., rotary_dim:]
    first, second = torch.chunk(rot, 2, dim=-1)
    out = rot * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def reference_rope(query, key, cos, sin):
    """Query and key rotated as megatron-core's ``apply_rotary_pos_emb`` (non-interleaved)."""
    return _rotate_half_rope(query, cos, sin), _rotate_half_rope(key, cos, sin)


def reference_cross_entropy(logits, labels):
    """The per-token cross entropy in fp32 (megatron-core's vocab-parallel one at TP = 1, up to rounding)."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


REFERENCE = {"norm": reference_norm, "swiglu": reference_swiglu, "rope": reference_rope, "cross_entropy": reference_cross_entropy}


@functools.cache
def compiled(op: str) -> Callable:
    """``torch.compile(dynamic=True)`` of the op's pointwise function (:data:`REFERENCE`): the token count is a
    symbol, so a new chunk length reuses the graph (one graph per op, dtype and device; built at its first call)."""
    return torch.compile(REFERENCE[op], dynamic=True)


def probe_compiler(device_type: str) -> tuple[object | None, str]:
    """``(torch.compile, "")`` where inductor can build kernels for ``device_type``, else ``(None, why not)``."""
    import shutil

    if not torch._dynamo.is_dynamo_supported():
        return None, f"torch.compile is not supported on this Python/torch {torch.__version__}"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return (torch.compile, "") if has_triton() else (None, "no usable Triton for torch.compile on CUDA")
    if device_type == "cpu":
        return (torch.compile, "") if shutil.which("g++") or shutil.which("c++") or shutil.which("clang++") else (
            None, "no C++ compiler for inductor on the CPU")
    return None, f"torch.compile on {device_type} not tried here"


def _liger_rope(function, query, key, cos, sin):
    """liger's ``LigerRopeFunction``: (b, heads, s, d) views of copies (it writes q/k in place, unmarked for
    autograd: never megatron-core's tensors), cos/sin (1, s, rotary_dim); back to [s, b, heads, d]."""
    q = query.transpose(0, 1).clone(memory_format=torch.contiguous_format).transpose(1, 2)
    k = key.transpose(0, 1).clone(memory_format=torch.contiguous_format).transpose(1, 2)
    q, k = function.apply(q, k, cos[:, 0, 0].unsqueeze(0), sin[:, 0, 0].unsqueeze(0))
    return q.permute(2, 0, 1, 3), k.permute(2, 0, 1, 3)


def _liger_cross_entropy(function, logits, labels):
    """liger's ``LigerCrossEntropyFunction`` per token (``reduction="none"``) over ``[s * b, V]``; it writes the
    gradient into the logits in its forward (the logits have no other reader here)."""
    loss = function.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), None, -100, 0.0, 0.0, "none")[0]
    return loss.float().view(labels.shape)


def liger_library(rms_norm: ModuleType | None, swiglu: ModuleType | None, rope: ModuleType | None,
                  cross_entropy: ModuleType | None, version: str) -> KernelLibrary:
    """liger-kernel's ops from its modules ``liger_kernel.ops.rms_norm``/``swiglu``/``rope``/``cross_entropy`` (None:
    not there; tests pass fakes): ``LigerRMSNormFunction`` (``casting_mode="llama"``: the inverse RMS in fp32, the
    normalised input cast before the weight, as torch's ``rms_norm``; ``in_place=False``: the output gradient is read
    again by the residual branch), ``LigerFusedGateUpSiLUMulFunction`` (gate first: megatron-core's fc1 layout),
    ``LigerRopeFunction`` (:func:`_liger_rope`) and ``LigerCrossEntropyFunction`` (:func:`_liger_cross_entropy`)."""
    ops: dict[str, Callable | None] = dict.fromkeys(OPS)
    if rms_norm is not None:
        norm = rms_norm.LigerRMSNormFunction
        ops["norm"] = lambda x, weight, eps, offset=0.0: norm.apply(x, weight, eps, offset, "llama", False)
    if swiglu is not None:
        ops["swiglu"] = lambda y: swiglu.LigerFusedGateUpSiLUMulFunction.apply(y, False)
    if rope is not None:
        ops["rope"] = functools.partial(_liger_rope, rope.LigerRopeFunction)
    if cross_entropy is not None:
        ops["cross_entropy"] = functools.partial(_liger_cross_entropy, cross_entropy.LigerCrossEntropyFunction)
    return KernelLibrary("liger", version, ops, min_capability=(8, 0))


def _quack_rope(apply_rotary_emb, query, key, cos, sin):
    """quack's ``apply_rotary_emb`` on (b, s, heads, d), cos/sin (s, rotary_dim / 2): each token's own row of
    angles (its position in its document, a split slice's at its offset), so no ``cu_seqlens``/``seqlen_offsets``."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, 0, 0, :half].contiguous(), sin[:, 0, 0, :half].contiguous()
    q = apply_rotary_emb(query.transpose(0, 1).contiguous(), cos, sin, interleaved=False, inplace=False)
    k = apply_rotary_emb(key.transpose(0, 1).contiguous(), cos, sin, interleaved=False, inplace=False)
    return q.transpose(0, 1), k.transpose(0, 1)


def quack_library(rmsnorm: Callable | None, apply_rotary_emb: Callable | None, cross_entropy: Callable | None,
                  version: str) -> KernelLibrary:
    """quack-kernels' ops from ``quack.rmsnorm``, ``quack.rotary.apply_rotary_emb`` and ``quack.cross_entropy`` (None:
    not there; tests pass fakes); sm90 and newer. No SwiGLU here: quack's gated activations are GEMM epilogues."""
    ops: dict[str, Callable | None] = dict.fromkeys(OPS)
    if rmsnorm is not None:
        ops["norm"] = lambda x, weight, eps, offset=0.0: rmsnorm(x, weight, eps=eps, weight_offset=offset)
    if apply_rotary_emb is not None:
        ops["rope"] = functools.partial(_quack_rope, apply_rotary_emb)
    if cross_entropy is not None:
        ops["cross_entropy"] = lambda logits, labels: cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").float().view(labels.shape)
    return KernelLibrary("quack", version, ops, min_capability=(9, 0))


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "?"


@functools.cache
def probe_liger() -> tuple[KernelLibrary | None, str]:
    """``(library, "")`` when liger-kernel's ops import (Triton with them), else ``(None, why not)``; probed once."""
    try:
        from liger_kernel.ops import cross_entropy, rms_norm, rope, swiglu
    except Exception as error:  # ImportError, or Triton built for another torch
        return None, f"liger-kernel does not import ({type(error).__name__}: {str(error)[:120]})"
    return liger_library(rms_norm, swiglu, rope, cross_entropy, _version("liger-kernel")), ""


@functools.cache
def probe_quack() -> tuple[KernelLibrary | None, str]:
    """``(library, "")`` when quack-kernels' ops import (the CuTe DSL with them), else ``(None, why not)``; probed once."""
    try:
        from quack.cross_entropy import cross_entropy
        from quack.rmsnorm import rmsnorm
        from quack.rotary import apply_rotary_emb
    except Exception as error:  # ImportError, or the CUTLASS DSL without its CUDA libraries
        return None, f"quack-kernels does not import ({type(error).__name__}: {str(error)[:120]})"
    return quack_library(rmsnorm, apply_rotary_emb, cross_entropy, _version("quack-kernels")), ""


def probe_libraries() -> dict[str, tuple[KernelLibrary | None, str]]:
    return {"liger": probe_liger(), "quack": probe_quack()}


def kernel(op: str, backend: str, libraries: dict[str, tuple[KernelLibrary | None, str]] | None = None) -> Callable:
    """The function that runs ``op`` on ``backend`` (:data:`REFERENCE`'s calling convention); ``libraries``: as
    probed (default :func:`probe_libraries`; tests pass fakes)."""
    if backend == "torch":
        return REFERENCE[op]
    if backend == "compile":
        return compiled(op)
    library, why = (libraries or probe_libraries()).get(backend, (None, f"no library {backend}"))
    if library is None or library.ops.get(op) is None:
        raise FusedKernelError(f"{LABELS[op]}={backend}: {why or 'no such kernel'}")
    return library.ops[op]


def select(request: dict[str, str], flags: FusedFlags, device: torch.device, dtype: torch.dtype) -> FusedChoice:
    """:func:`decide` with this machine's probes (the libraries and torch.compile are probed only on CUDA or where a
    request names them; on the CPU ``auto`` probes nothing)."""
    named = {value.removeprefix("all:") for value in request.values()}
    on_cuda = device.type == "cuda"
    libraries = {name: (probe_liger if name == "liger" else probe_quack)() if on_cuda or name in named
                 else (None, "not probed off CUDA") for name in LIBRARIES}
    compiler = probe_compiler(device.type) if on_cuda or "compile" in named else (None, "not probed off CUDA")
    capability = torch.cuda.get_device_capability(device) if on_cuda else None
    return decide(request, flags, device.type, dtype, libraries, compiler, capability)
