"""A cost-model *profile* (:class:`Profile`): the coefficients of one model shape and device, and its JSON file.

A profile holds, per transformer layer of one pipeline stage (already divided by the stage's
tensor-parallel size), the fitted time coefficients of the cost model (docs/planner.md, "Time model") for
forward, backward and recompute, the output head's cost on the last stage, and the memory
coefficients. Times are in milliseconds, memory in bytes.

Time of one layer on one chunk, with the chunk's segments ``(s, C)`` (length, context length)::

    t = a1 * sum(s^2) + a1c * sum(s * C) + a2 * sum(s) + ac * sum(C) + bs * segments + b1

With a flash-style causal kernel ``a1c = 2 * a1``, i.e. ``a1 * ((C + s)^2 - C^2)`` as in the notes
(on CPU the ``sdpa-merged`` kernel is one: causal own block, unmasked prefix);
an attention with an explicit boolean mask computes the whole ``s x (C + s)`` rectangle, so
``a1c ~ a1`` (the CPU profiles before 2026-11-24, fitted on ``sdpa-masked``); the profiler fits both. ``ac`` is a cost per prefix token outside the attention's
area (it was fitted while slices concatenated their prefix K/V before the attention call; they now
read it in place from the sequence's K/V buffer, as a GPU kernel reads a cache). ``bs`` is a per-segment launch cost (an attention call per
segment on CPU; 0 for a varlen GPU kernel), ``b1`` the per-chunk launch constant.

The time coefficients belong to the shape they were measured at (``Profile.time_model``); a profile
placed on another shape is rescaled by FLOPs (:func:`~megatron_epp.cost.analytic.shape_time`), as its activation
memory is re-derived (:func:`~megatron_epp.cost.activation_memory.shape_memory`); both are applied when a
``CostModel`` is built.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_epp.cost.shape import DTYPE_BYTES, ModelShape

PROFILE_SOURCES = ("measured", "analytic")  # a profile's "source": fitted to timings, or FLOPs / peak x MFU


@dataclass(frozen=True)
class TimeCoeffs:
    """Per-layer time coefficients (ms) over the features of :mod:`megatron_epp.cost.features`
    ``[sum s^2, sum s*C, sum s, sum C, segments, chunks]``, in that order."""

    a1: float
    a1c: float
    a2: float
    ac: float
    bs: float
    b1: float

    def vector(self) -> np.ndarray:
        return np.array([self.a1, self.a1c, self.a2, self.ac, self.bs, self.b1])


@dataclass(frozen=True)
class MemoryCoeffs:
    """Per-GPU memory coefficients in bytes.

    ``act_token`` / ``act_area`` / ``act_context``: activations one layer keeps for backward per
    token, per unit of attention area ``s * (C + s)`` (0 with flash attention) and per prefix token
    of a segment (a copy of the prefix K/V saved by the attention: 0 where, as here, the slice reads
    its sequence's K/V buffer in place). ``act_slice``: per own token of the slice with context (the
    same copy covers its ``s`` tokens too). ``lone_slice_token``: per token, what a chunk that is only
    a slice of a split sequence (any context, the first slice too) does *not* save: its own K/V as
    the QKV projection produced them, since its attention reads them from the K/V buffer.
    ``ckpt_token``: what a checkpointed layer keeps (its input). ``kv_token``: a split sequence's K/V
    buffer per layer and per token of the *whole* sequence (its K and V rows), allocated by the
    forward of the sequence's first slice and freed, layer by layer, by that slice's backward.
    ``logits_token``: what the output head (final norm, output layer, loss) keeps on the last stage
    per token; ``embed_token``: what the embedding keeps on the first stage per token.
    ``bwd_workspace``: layers of full activations counted as workspace during a backward (gradient
    buffers: 1 where the allocator is measured, 0 where saved tensors are). ``kv_grad``: a split
    sequence's K/V gradient accumulators per byte of its K/V buffer (the gradients later slices
    accumulate for earlier slices' rows, as large as the buffer, from the sequence's first backward, its
    last slice's, until its first slice's backward frees them layer by layer: 1 where the allocator is
    measured, 0 where saved tensors are). Model states per
    parameter: ``weight``, ``grad`` and ``optim`` bytes (the last divided by the data-parallel size
    when ``distributed_optimizer``). ``p2p_token``: bytes one GPU sends per token between stages.
    ``recompute_input_token``: what a recomputing layer holds beside its own saved tensors and its kept
    input (``ckpt_token``) per token, where those do not share the kept input's storage (RMSNorm on a
    bf16 input saves an fp32 copy of it, not the input: ``b h``; 0 where the first norm saves the
    input itself). ``derive``: ``""`` (the numbers as given), the analytic count the activation coefficients are
    re-derived from for the profile's model shape (:func:`shape_memory`): ``"saved-tensors"`` (what
    autograd saves on CPU, counted tensor by tensor in the shape's dtype) or ``"megatron-gpu"`` (Megatron's
    ``34 h / tp`` with flash attention), or ``"measured"`` (:data:`MEASURED_MEMORY`: ``act_token``, ``ckpt_token``,
    ``logits_token`` and, on a GPU, ``bwd_workspace`` were measured by the start-up profiler at the profile's
    ``time_model`` and ``tp``, not re-derived; on another shape or TP they are carried by ``basis``'s ratio,
    :func:`carry_measured_memory`). ``basis``: for ``"measured"``, the analytic count (``"saved-tensors"`` or
    ``"megatron-gpu"``) that gives the coefficients the profiler does not measure and carries the measured ones.
    """

    act_token: float
    act_area: float
    act_context: float
    ckpt_token: float
    kv_token: float
    logits_token: float
    weight: float
    grad: float
    optim: float
    distributed_optimizer: bool
    p2p_token: float
    act_slice: float = 0.0
    lone_slice_token: float = 0.0
    embed_token: float = 0.0
    bwd_workspace: float = 1.0
    kv_grad: float = 1.0
    derive: str = ""
    recompute_input_token: float = 0.0
    basis: str = ""


def megatron_model_state(dtype: str, distributed_optimizer: bool) -> dict[str, Any]:
    """``MemoryCoeffs`` model-state bytes per parameter of this project's Megatron-Core training: the weight in
    the parameters' dtype; its gradient in fp32 (DDP ``grad_reduce_in_fp32``); Adam's two fp32 moments, plus
    the fp32 main copy of a bf16 weight; the optimizer's bytes sharded over the data-parallel ranks with
    ``--use-distributed-optimizer``."""
    weight = float(DTYPE_BYTES[dtype])
    return {"weight": weight, "grad": 4.0, "optim": 8.0 + (4.0 if weight < 4 else 0.0),
            "distributed_optimizer": distributed_optimizer}


@dataclass(frozen=True)
class StageOverhead:
    """The pipeline executor's own time per chunk on every stage, outside the layers (ms).

    ``fwd_ms`` / ``bwd_ms``: added to each chunk's forward / backward on every stage (megatron-core's
    ``forward_step`` / ``backward_step``, the chunk's layout and masks, the point-to-point calls and
    their synchronisation, the embedding on the first stage, autograd hooks). Fitted on real
    executor steps by ``benchmarks/calibrate_step.py`` (0 for analytic profiles); ``fit`` holds its
    provenance (machine, load, runs, errors before/after). The training driver refits it on its own
    steps, with the machine's speed factor (:mod:`megatron_epp.planner.calibration`).
    """

    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    fit: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Profile:
    """Cost-model coefficients of one model shape at one tensor-parallel size on one device."""

    model: ModelShape
    device: str
    source: str  # "measured" (fitted to timings) or "analytic" (FLOPs / peak * MFU)
    tp: int
    fwd: TimeCoeffs
    bwd: TimeCoeffs
    recompute: TimeCoeffs
    head_fwd: TimeCoeffs
    head_bwd: TimeCoeffs
    memory: MemoryCoeffs
    fit: dict[str, Any] = field(default_factory=dict)
    overhead: StageOverhead = field(default_factory=StageOverhead)
    # the shape the time coefficients were measured (or derived) at; ``model`` when not given. A
    # profile placed on another shape (``replace(profile, model=...)``) keeps it, and
    # :func:`shape_time` rescales the coefficients from it to ``model``.
    time_model: ModelShape | None = None
    # Megatron's sequence parallelism at ``tp`` > 1 (``--sequence-parallel``): the activations outside attention are
    # split over the tensor-parallel ranks, and every chunk is padded to a multiple of ``tp`` tokens
    # (``CostModel.costs``); counted by the ``saved-tensors`` derivation
    sequence_parallel: bool = False
    # context parallelism (Ulysses all-to-all, ``--context-parallel-size``) inside the stage: a GPU holds ``1 / cp`` of
    # a chunk's tokens outside core attention and ``heads / cp`` inside it (``cost.placement.place_profile`` places a
    # profile at ``cp``: times, all-to-alls; the memory derivations count a CP rank's share)
    cp: int = 1

    def __post_init__(self) -> None:
        if self.time_model is None:
            object.__setattr__(self, "time_model", self.model)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profile":
        # every profile says where its numbers come from: the planner prints it beside its predictions
        missing = [key for key in ("device", "source") if not d.get(key)]
        if missing:
            raise ValueError(f"profile has no {' or '.join(repr(k) for k in missing)}: every profile names its device "
                             f"and its source ({' or '.join(PROFILE_SOURCES)})")
        if d["source"] not in PROFILE_SOURCES:
            raise ValueError(f"profile source {d['source']!r}: expected {' or '.join(PROFILE_SOURCES)}")
        tc = {k: TimeCoeffs(**d[k]) for k in ("fwd", "bwd", "recompute", "head_fwd", "head_bwd")}
        return cls(
            model=ModelShape(**d["model"]),
            device=d["device"],
            source=d["source"],
            tp=d["tp"],
            memory=MemoryCoeffs(**d["memory"]),
            fit=dict(d.get("fit", {})),
            overhead=StageOverhead(**d["overhead"]) if "overhead" in d else StageOverhead(),
            time_model=ModelShape(**d["time_model"]) if d.get("time_model") else None,
            sequence_parallel=bool(d.get("sequence_parallel", False)),
            cp=int(d.get("cp", 1)),
            **tc,
        )

    def save(self, path: str | Path) -> None:
        """Write the profile JSON atomically: a temporary file in the same folder, renamed over ``path``, so a
        reader (another rank, a concurrent run sharing the cache) sees the old file or the whole new one."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.to_dict(), indent=1) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except ValueError as error:  # JSON that does not parse, or metadata missing
            raise ValueError(f"{path}: {error}") from None
