"""Model shapes, cost-model coefficients (a *profile* per model shape and device) and presets.

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
placed on another shape is rescaled by FLOPs (:func:`shape_time`), as its activation memory is
re-derived (:func:`shape_memory`); both are applied when a ``CostModel`` is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

PROFILE_DIR = Path(__file__).parent / "profiles"
GIB = float(2**30)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # activation dtypes the saved-tensor count is measured in
PROFILE_SOURCES = ("measured", "analytic")  # a profile's "source": fitted to timings, or FLOPs / peak x MFU


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (LLaMA-style: SwiGLU MLP, untied output layer).

    ``num_kv_heads``: K/V heads (grouped-query attention; None: ``num_heads``); ``kv_channels``: the
    head dimension (None: ``hidden / num_heads``); ``normalization``: ``LayerNorm`` or ``RMSNorm``;
    ``bias``: the linear layers have biases (``--disable-bias-linear``: False).
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    ffn_hidden: int
    vocab: int
    num_kv_heads: int | None = None
    swiglu: bool = True
    rope: bool = True  # rotary positions (False: learned absolute positions); changes what attention saves
    dtype: str = "float32"  # the activations' dtype (DTYPE_BYTES): what autograd saves and the K/V buffers hold
    kv_channels: int | None = None
    normalization: str = "LayerNorm"
    bias: bool = True
    # parameters beyond the layers' weights, counted by ``rank_parameters`` (model states): one embedding table
    # shared with the output layer, and the rows of a learned position table (0: none, RoPE)
    tied_embeddings: bool = False
    learned_positions: int = 0
    # dropout probabilities in training (``--hidden-dropout``, ``--attention-dropout``): what the dropouts save
    # (their masks; on CPU attention dropout takes SDPA's math path) is counted by the memory derivations
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.num_heads

    @property
    def q_hidden(self) -> int:
        """The queries' (and the attention output's) width: ``heads x head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_hidden(self) -> int:
        """The keys' (or values') width: ``kv_heads x head_dim``."""
        return (self.num_kv_heads or self.num_heads) * self.head_dim

    def gemm_params_per_layer(self) -> int:
        """Weights of the layer's GEMMs: QKV, output projection, MLP (fc1 twice as wide with SwiGLU)."""
        h = self.hidden
        return h * (self.q_hidden + 2 * self.kv_hidden) + self.q_hidden * h + (3 if self.swiglu else 2) * h * self.ffn_hidden

    @property
    def norm_params(self) -> int:
        """One norm's parameters: a weight, and a bias for LayerNorm."""
        return (2 if self.normalization == "LayerNorm" else 1) * self.hidden

    def params_per_layer(self) -> int:
        """Every parameter of a layer: GEMM weights, two norms, biases."""
        h, f = self.hidden, self.ffn_hidden
        norms = 2 * self.norm_params
        biases = (self.q_hidden + 2 * self.kv_hidden + h + (2 if self.swiglu else 1) * f + h) if self.bias else 0
        return self.gemm_params_per_layer() + norms + biases

    def rank_parameters(self, layers_per_stage: Sequence[int], tp: int) -> np.ndarray:
        """Parameters one tensor-parallel rank of each pipeline stage holds, exactly as Megatron-Core's GPTModel
        builds them: the column/row-parallel weights, the column-parallel biases and the vocabulary split by
        ``tp``; norms, row-parallel biases and learned positions whole on every rank. The first stage holds the
        embedding (and positions), the last the final norm and the output layer (the embedding itself when tied
        on one stage; a copy of it on the last stage when tied across stages)."""
        h, q, kv, f, b = self.hidden, self.q_hidden, self.kv_hidden, self.ffn_hidden, int(self.bias)
        fc1 = (2 if self.swiglu else 1) * f
        split = h * (q + 2 * kv) + q * h + h * fc1 + f * h + b * (q + 2 * kv + fc1)  # QKV, proj, fc1, fc2 (+ biases)
        whole = 2 * self.norm_params + b * 2 * h  # two norms, proj and fc2 biases
        params = np.asarray(layers_per_stage, dtype=float) * (split / tp + whole)
        params[0] += self.vocab * h / tp + self.learned_positions * h
        params[-1] += self.norm_params + (0 if self.tied_embeddings and len(params) == 1 else self.vocab * h / tp)
        return params

    def gemm_flops_per_token(self) -> float:
        """Forward GEMM FLOPs of one layer per token (2 per multiply-add)."""
        return 2.0 * self.gemm_params_per_layer()

    def training_flops(self, seq_lengths) -> float:
        """Model FLOPs of one training pass (forward + backward = 3 x forward; recompute not counted) over causal
        sequences of ``seq_lengths`` tokens, each attending only to itself: per layer the GEMMs per token and,
        per sequence of ``n`` tokens, ``n (n + 1) / 2`` query-key pairs at ``4 heads x head_dim`` FLOPs each (``Q K^T`` and
        ``P V``); the output layer ``2 h V`` per token. A sequence cut into slices has the same pairs (each
        slice's queries attend to the slices before it and causally to itself), so it counts as the whole."""
        n = np.asarray(seq_lengths, dtype=np.float64)
        tokens, pairs = n.sum(), (n * (n + 1) / 2).sum()
        layer = self.gemm_flops_per_token() * tokens + 4.0 * self.q_hidden * pairs
        return 3.0 * (self.num_layers * layer + 2.0 * self.hidden * self.vocab * tokens)


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
    executor steps by ``scripts/calibrate_step.py`` (0 for analytic profiles); ``fit`` holds its
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
    # a chunk's tokens outside core attention and ``heads / cp`` inside it (``cost.clusters.cp_profile`` places a
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


_LLAMA = {"normalization": "RMSNorm", "bias": False}  # and SwiGLU, RoPE: ModelShape's defaults
# Published LLaMA shapes (LLaMA-1 paper, table 2; "30B" is the 32.5B model), trained in bf16.
MODEL_PRESETS: dict[str, ModelShape] = {
    "llama-7b": ModelShape("llama-7b", 32, 4096, 32, 11008, 32000, dtype="bfloat16", **_LLAMA),
    "llama-13b": ModelShape("llama-13b", 40, 5120, 40, 13824, 32000, dtype="bfloat16", **_LLAMA),
    "llama-30b": ModelShape("llama-30b", 60, 6656, 52, 17920, 32000, dtype="bfloat16", **_LLAMA),
}

# The CPU test model of the project (fp32, one thread): GPT-style GELU MLP, 8 layers.
TEST_MODEL = ModelShape("test-model", 8, 64, 4, 256, 512, swiglu=False)


@dataclass(frozen=True)
class Accelerator:
    """Peak dense throughput and the constants of the analytic profile."""

    name: str
    peak_tflops: float
    mfu: float = 0.5
    attn_mfu: float = 0.4
    tp_bw_gbps: float = 450.0  # NVLink bus bandwidth per GPU for tensor-parallel all-reduce
    tp_overlap: float = 0.5  # fraction of the tensor-parallel communication hidden behind GEMMs
    launch_ms: float = 0.08  # per layer and chunk in forward (kernel launches, small-GEMM waste)


H100 = Accelerator("H100-SXM bf16", 990.0)


def analytic_profile(shape: ModelShape, tp: int = 8, acc: Accelerator = H100) -> Profile:
    """GPU profile from FLOPs: GEMMs at ``mfu``, flash attention at ``attn_mfu``, bf16, TP+SP.

    Backward = 2x forward GEMMs and 2.5x forward attention; recompute = forward. Tensor-parallel
    reduce-scatter/all-gather time (2 per layer forward, 2 backward, ring over ``tp`` GPUs), less the
    part ``tp_overlap`` hidden behind GEMMs, is added to the per-token term. Activations follow Megatron's ``34 h / tp`` bytes per token
    per layer (bf16, sequence parallel, flash attention: no quadratic term).
    """
    h, flops = shape.hidden, acc.peak_tflops * 1e12
    ms_per_gemm_flop = 1e3 / (flops * acc.mfu * tp)
    ms_per_attn_flop = 1e3 / (flops * acc.attn_mfu * tp)
    # causal pairs of a segment: ((C+s)^2 - C^2) / 2 = s^2/2 + s*C; 4 h FLOPs per pair (QK^T, PV)
    a1 = 2.0 * h * ms_per_attn_flop
    comm = 2 * 2 * (tp - 1) / tp * h * 2 / (acc.tp_bw_gbps * 1e9) * 1e3 * (1 - acc.tp_overlap)
    fwd = TimeCoeffs(a1, 2 * a1, shape.gemm_flops_per_token() * ms_per_gemm_flop + comm, 0.0, 0.0, acc.launch_ms)
    bwd = TimeCoeffs(2.5 * a1, 5 * a1, 2 * shape.gemm_flops_per_token() * ms_per_gemm_flop + comm, 0.0, 0.0, 2 * acc.launch_ms)
    head = 2.0 * h * shape.vocab * ms_per_gemm_flop
    memory = MemoryCoeffs(
        **gpu_activation_memory(shape, tp),
        weight=2.0,
        grad=4.0,
        optim=12.0,
        distributed_optimizer=True,
        p2p_token=2.0 * h / tp,
        derive="megatron-gpu",
    )
    return Profile(
        model=shape,
        device=f"{acc.name} x{tp} (TP)",
        source="analytic",
        tp=tp,
        fwd=fwd,
        bwd=bwd,
        recompute=fwd,
        head_fwd=TimeCoeffs(0.0, 0.0, head, 0.0, 0.0, 0.0),
        head_bwd=TimeCoeffs(0.0, 0.0, 2 * head, 0.0, 0.0, 0.0),
        memory=memory,
        time_model=shape,
        fit={"note": f"analytic: peak {acc.peak_tflops} TFLOP/s, MFU {acc.mfu} (attention {acc.attn_mfu}), TP overlap {acc.tp_overlap}; not measured"},
    )


def kv_heads_split(shape: ModelShape, tp: int, cp: int) -> bool:
    """Whether context parallelism of size ``cp`` splits the K/V heads of a tensor-parallel rank (``cp`` divides them:
    each CP rank holds ``1 / cp`` of them after the all-to-all) rather than replicating them (every CP rank holds all
    of the TP rank's K/V heads, gathered over the CP group: grouped-query attention with fewer K/V heads than ``cp``)."""
    return cp == 1 or ((shape.num_kv_heads or shape.num_heads) / tp) % cp == 0


def check_context_parallel(shape: ModelShape, tp: int, cp: int) -> None:
    """A one-line ``ValueError`` unless ``cp`` (>= 1) divides the attention heads of a tensor-parallel rank."""
    heads = shape.num_heads / tp
    if cp < 1 or (cp > 1 and heads % cp):
        raise ValueError(f"--context-parallel-size {cp}: must divide the {heads:g} attention heads per tensor-parallel rank "
                         f"({shape.num_heads} heads, TP={tp})")


def gpu_activation_memory(shape: ModelShape, tp: int, cp: int = 1) -> dict[str, float]:
    """Megatron's activation count per layer and token (bf16 whatever the shape's dtype, sequence
    parallel, flash attention: no quadratic term), ``34 h / tp`` for a GPT layer: the attention's
    QKV input ``2 h``, Q ``2 q``, K and V ``2 * 2 h_kv``, the output projection's input ``2 q`` and a
    dropout mask ``h``; the MLP's fc1 input ``2 h``, activation input ``2 f`` (SwiGLU: fc1's whole
    output, ``4 f``), fc2 input ``2 f`` and a dropout mask ``h``; the two norms' inputs ``4 h``
    (``q = heads x head_dim``, ``h_kv`` the K/V heads' width: GQA saves smaller K and V). K and V are
    what a lone slice reads from its K/V buffer instead; a checkpointed layer keeps its bf16 input.

    Dropout on CUDA (modelled, not measured): the two hidden-dropout masks above are one byte per element
    (``native_dropout``'s boolean mask; Megatron's count has them whatever the probability, so at ``hidden_dropout``
    0, where nothing is saved, this over-counts ``2 h / tp``), and with ``hidden_dropout`` above 0 the first stage's
    embedding dropout saves one more (``embed_token`` = ``h / tp``, sequence parallel); attention dropout adds
    nothing: flash-attn's and SDPA's flash / memory-efficient kernels keep only the RNG state.

    Context parallelism ``cp`` (Ulysses: :func:`saved_tensor_memory` has the layout), per token of the chunk (its
    padded tokens, all CP ranks'): outside core attention a rank holds ``1 / cp`` of the tokens, so every term above
    is divided by ``cp`` except K and V, ``2 * 2 h_kv / tp / cp`` when ``cp`` divides the rank's K/V heads
    (:func:`kv_heads_split`) else ``2 * 2 h_kv / tp`` (replicated), and core attention saves its output
    (``2 q / tp / cp``) apart from the output projection's input (the all-to-all back makes a new tensor); a split
    sequence's K/V buffer holds this rank's K/V heads. At ``cp`` = 1 the count above."""
    check_context_parallel(shape, tp, cp)
    h, q, f = shape.hidden, shape.q_hidden, shape.ffn_hidden
    kv = 2 * 2.0 * shape.kv_hidden / tp / (cp if kv_heads_split(shape, tp, cp) else 1)
    attention = 2 * h + 2 * q + 2 * q + h + (2 * q if cp > 1 else 0)
    mlp = 2 * h + (4 if shape.swiglu else 2) * f + 2 * f + h
    share = tp * cp  # the GPUs a chunk's tokens (outside core attention) or its heads (inside) are divided over
    return {
        "act_token": (attention + mlp + 4 * h) / share + kv, "act_area": 0.0, "act_context": 0.0, "ckpt_token": 2.0 * h / share,
        "kv_token": kv, "lone_slice_token": kv, "logits_token": 4.0 * shape.vocab / share,
        "embed_token": h / share if shape.hidden_dropout > 0 else 0.0,
    }


def _counted_activation_bytes(shape: ModelShape) -> float:
    """Bytes per activation element of ``shape`` for :func:`saved_tensor_memory`; a dtype or a norm it does not count
    is a ValueError."""
    if shape.dtype not in DTYPE_BYTES:
        raise ValueError(f"saved_tensor_memory: activations of dtype {shape.dtype} are not counted (known: {', '.join(DTYPE_BYTES)})")
    if shape.normalization not in NORM_SAVED:
        raise ValueError(f"saved_tensor_memory: normalization {shape.normalization} is not counted (known: {', '.join(NORM_SAVED)})")
    b = float(DTYPE_BYTES[shape.dtype])
    return b


def _saved_attention(shape: ModelShape, b: float, q: float, kv: float, heads: float,
                     all_to_all: bool = False) -> tuple[float, float, float, float]:
    """:func:`saved_tensor_memory`'s attention term on one tensor-parallel rank (``q``, ``kv``, ``heads``: its share
    of the queries' width, the K/V heads' width and the query heads; ``b`` bytes per activation): the bytes saved per
    token (``act_token``'s share), per query-key pair (``act_area``), per prefix key (``act_context``) and per token of
    a chunk that is only a slice (``lone_slice_token``):

    * RoPE (the elastic layers' rotation, ``executor.rotary``: its cos/sin tables are shared by the stage's
      layers and rebuilt for backward, nothing saved): q and k after RoPE (``b q`` and ``b h_kv``, new
      storages) and V as a view of the QKV output (``b (q + 2 h_kv)``); without RoPE q, k and v are all
      views of the QKV output;
    * SDPA (CPU flash kernel, ``sdpa-merged``: ``is_causal`` for a segment without context, the slice's
      prefix and own keys in two calls merged by their log-sum-exp, which saves the same tensors; no
      mask; ``enable_gqa``: the K/V heads as they are, no repeated copies): q, k, v, its output (``b q``)
      and the logsumexp (fp32 per query head): no quadratic term (``act_area`` = 0; the explicit-mask
      kernel, ``sdpa-masked``, saved a float copy of the mask per layer, ``b s (C + s)`` per segment);
    * an attention dropout takes SDPA off its CPU flash kernel (which has no dropout) to its math path, which
      computes in fp32 (a bf16 q, k, v upcast) and saves, per segment of ``s`` queries and ``K = C + s`` keys, in
      place of the flash kernel's tensors (the RoPE'd q and k, its output, the logsumexp, the float mask): the
      scaled q (``4 q`` per token) and k (``4 q`` per key: the K/V heads repeated over the query heads under
      grouped-query attention), v as a view of the QKV output (fp32, one K/V head per query head) or else an
      fp32, repeated copy (``4 q`` per key), and ``MATH_SDPA_SAVED`` = 3 fp32 tensors of ``heads x s x K``
      (probabilities, dropout mask, dropped probabilities): ``act_area`` = ``12 heads``, ``act_context`` =
      ``4 q`` or ``8 q`` per prefix key (the slice's k, v copies of its buffer's rows); the QKV output stays
      saved only as v's storage, so a lone slice (its v read from the buffer) does not save it.

    ``all_to_all`` (context parallelism): q, k and v reach core attention through their own all-to-alls (after RoPE,
    which runs on the rank's own tokens), new storages of ``b q``, ``b h_kv``, ``b h_kv`` per token (this rank's
    heads over all the chunk's tokens), which the kernel saves in place of the RoPE outputs and the QKV output (those
    are the all-to-alls' inputs, saved by nothing); the flash kernel's output is saved apart from the output
    projection's input (the all-to-all back is a new tensor); a lone slice does not save its k and v (read from its
    buffer); on the math path v is a view of its all-to-all output unless copied.
    """
    if all_to_all:
        if shape.attention_dropout > 0:  # SDPA's math path, in fp32 (MATH_SDPA_SAVED)
            v_copy = b != 4 or kv != q
            attention = (0.0 if v_copy else b * kv) + 4 * q * (3 if v_copy else 2)
            return attention, 4 * MATH_SDPA_SAVED * heads, 4 * q * (2 if v_copy else 1), 0.0 if v_copy else b * kv
        return b * q + 2 * b * kv + b * q + 4 * heads, 0.0, 0.0, 2 * b * kv
    qkv = b * (q + 2 * kv)
    if shape.attention_dropout > 0:  # SDPA's math path, in fp32 (MATH_SDPA_SAVED)
        v_copy = b != 4 or kv != q  # V upcast to fp32 or repeated over the query heads: not a view of the QKV output
        attention = (0.0 if v_copy else qkv) + 4 * q * (3 if v_copy else 2)  # + the scaled q, k (and v) copies
        area, prefix = 4 * MATH_SDPA_SAVED * heads, 4 * q * (2 if v_copy else 1)  # probabilities; k (and v) per key
        lone = 0.0 if v_copy else qkv
    else:  # SDPA's CPU flash kernel: q, k after RoPE, the QKV output (q, k, v without RoPE); its output, logsumexp
        attention = (b * q + b * kv + qkv if shape.rope else qkv) + b * q + 4 * heads
        area, prefix = 0.0, 0.0  # no mask (sdpa-merged)
        lone = b * kv + qkv if shape.rope else 0.0
    return attention, area, prefix, lone


def saved_tensor_memory(shape: ModelShape, tp: int = 1, sequence_parallel: bool = False, cp: int = 1) -> dict[str, float]:
    """Bytes autograd saves for backward, counted tensor by tensor (deduplicated by storage, as
    :class:`~megatron_epp.executor.memory_tracker.ActivationMemoryTracker` counts them), for one
    Megatron-Core local-spec layer with :class:`ElasticAttention` on the SDPA-masked path (CPU),
    activations of ``b`` bytes (``DTYPE_BYTES`` of the shape's dtype: a model cast to bf16 saves
    half, except the fp32 logsumexp, RMSNorm's fp32 internals and logits' softmax), no dropout (below). With
    ``q = heads x d`` the queries' width (``d`` the head dimension, ``kv_channels``) and ``h_kv`` the
    K/V heads' (grouped-query attention: fewer K/V heads), per token of a chunk, one layer saves:

    * each of the two norms: LayerNorm its input ``b h`` and its mean and rstd (``2 b``: the input's
      dtype on CPU); RMSNorm (PyTorch's composite ``torch.nn.RMSNorm``, computed in fp32) the fp32
      input, its rstd and the fp32 normalised input before the weight: ``8 h + 4`` in any dtype;
    * the QKV linear: its input ``b h``;
    * attention (RoPE and SDPA): :func:`_saved_attention`;
    * the output projection's input ``b q``; fc1's input ``b h``; the MLP's activation: GELU its
      input ``b f`` and fc2's input ``b f``; SwiGLU (megatron-core's unfused ``glu``) fc1's whole
      output ``2 b f`` (SiLU's input is a view of it), SiLU's output, the linear half plus its offset
      (a new tensor) and fc2's input, ``b f`` each: ``5 b f``.

    Biases save nothing (``--disable-bias-linear`` changes no activation). A split sequence's K/V
    buffer holds ``2 b h_kv`` per token of the whole sequence and layer (``kv_token``: its K and V rows);
    each slice writes its K/V there and SDPA reads (and saves) the slice's rows ``[0, C + s)`` in place,
    so no copy of the prefix is saved (``act_context`` = ``act_slice`` = 0). In a chunk that is only a
    slice, the K after RoPE and the QKV output are then saved by nothing (``lone_slice_token``; without
    RoPE the query is a view of the QKV output, which stays saved). A checkpointed layer keeps its input
    (``b h``). The last stage keeps the final norm (as above), the output layer's input (``b h``), the
    fp32 softmax of the logits (``4 V``), the loss's target mask and indices (1 + 8) and the loss mask
    (4); the first stage the token ids (8; and position ids, 8, with learned positions; at tp > 1 the ids
    shifted to the rank's vocabulary share and the boolean mask of the ids outside it, 8 + 1). Measured by
    ``tests/integration/test_planner_memory.py`` against the tracker on real chunks, fp32 and bf16, GPT- and
    LLaMA-style, and at tp 2 with sequence parallelism.

    With ``sequence_parallel`` each tensor-parallel rank holds ``1 / tp`` of a chunk's tokens outside attention:
    the norms' saved tensors, the QKV and fc1 inputs (megatron-core's sequence-parallel linear saves its input
    shard and all-gathers it again in backward), a checkpointed layer's input, the final norm's and the output
    layer's inputs and RMSNorm's recompute copy are divided by ``tp``; attention and the MLP's activations are
    over the whole (gathered) chunk with ``heads / tp`` and ``ffn / tp`` as without it; the ids, the loss's
    targets and mask are whole on every rank. The counts are per token of the padded chunk (``CostModel.costs``).

    Dropout (the shape's ``hidden_dropout`` / ``attention_dropout`` above 0; nothing at 0), as measured on CPU:

    * a hidden dropout (megatron-core's unfused bias-dropout-add after the output projection and after the MLP,
      and the embedding's dropout on the first stage) saves its scaled keep mask, a tensor of the input's dtype
      (PyTorch's CPU dropout is ``x * mask``): ``b h`` per token and site, divided by ``tp`` under sequence
      parallelism (the embedding's dropout runs after the scatter to the sequence-parallel region);
    * an attention dropout takes SDPA to its math path: :func:`_saved_attention`.

    Measured byte-exact by ``tests/integration/test_planner_memory.py`` (the cases: docs/planner.md). On CUDA the
    :func:`gpu_activation_memory` count holds instead (one-byte dropout masks, no attention-dropout tensors).

    Context parallelism ``cp``: one CP rank's bytes per token of the whole (padded) chunk, as docs/planner.md's
    "Activation memory model" says; at ``cp`` = 1 the count above.
    """
    check_context_parallel(shape, tp, cp)
    b = _counted_activation_bytes(shape)
    sp = (tp if sequence_parallel else 1) * cp  # the share of a chunk's tokens a rank holds outside attention
    H = shape.hidden  # norm inputs and outputs are whole on every tensor-parallel rank
    q, kv, heads, f = shape.q_hidden / tp, shape.kv_hidden / tp, shape.num_heads / tp, shape.ffn_hidden / tp
    kv_rank = kv / cp if kv_heads_split(shape, tp, cp) else kv  # inside core attention
    norm = NORM_SAVED[shape.normalization](b, H) / sp
    attention, area, prefix, lone = _saved_attention(shape, b, q / cp, kv_rank, heads / cp, all_to_all=cp > 1)
    mask = b * H / sp if shape.hidden_dropout > 0 else 0.0  # a hidden dropout's mask (CPU: the scaled keep mask in b)
    per_token = (
        2 * norm  # the two norms
        + 2 * b * H / sp  # QKV linear and fc1 inputs
        + attention
        + b * q / cp  # output projection input
        + (5 if shape.swiglu else 2) * b * f / cp  # the MLP's activation and fc2 inputs
        + 2 * mask  # the hidden dropouts after attention and after the MLP
    )
    return {
        "act_token": per_token, "act_area": area, "act_context": prefix, "act_slice": 0.0,
        "lone_slice_token": lone, "ckpt_token": b * H / sp, "kv_token": 2 * b * kv_rank,
        "logits_token": norm + b * H / sp + (4 * shape.vocab / tp + 13) / cp,
        "embed_token": ((8.0 if shape.rope else 16.0) + (tp > 1)) / cp + mask,  # + the embedding's dropout
        "bwd_workspace": 0.0,
        "kv_grad": 0.0,
        # the recomputed layer's first norm saves its input itself, except RMSNorm's fp32 copy of a bf16 input
        "recompute_input_token": b * H / sp if shape.normalization == "RMSNorm" and b != 4 else 0.0,
    }


# fp32 tensors per head and query-key pair SDPA's CPU math path saves with dropout (saved_tensor_memory): the
# softmax's probabilities, the dropout's scaled keep mask, the dropped probabilities (the input of ``P V``)
MATH_SDPA_SAVED = 3

# bytes one norm saves per token, from the activations' bytes ``b`` and the hidden size (saved_tensor_memory)
NORM_SAVED = {
    "LayerNorm": lambda b, h: b * h + 2 * b,  # input; mean and rstd in the input's dtype
    "RMSNorm": lambda b, h: 8.0 * h + 4.0,  # fp32 input (a copy unless fp32), fp32 rstd, fp32 normalised input
}


_DERIVATIONS = {"saved-tensors": saved_tensor_memory, "megatron-gpu": gpu_activation_memory}
# ``MemoryCoeffs.derive`` of a memory block the start-up profiler measured (``training.profiling.measure_profile``), and
# the per-token coefficients it measures (``bwd_workspace``, a ratio, is measured on a GPU's allocator too)
MEASURED_MEMORY = "measured"
MEASURED_COEFFS = ("act_token", "ckpt_token", "logits_token")
ALLOCATOR_COEFFS = ("bwd_workspace", "kv_grad")  # what an allocator adds to the saved tensors: as measured, never carried


def derived_memory(derive: str, shape: ModelShape, tp: int, sequence_parallel: bool = False, cp: int = 1) -> dict[str, float]:
    """The activation coefficients of the analytic count ``derive`` (``saved-tensors`` or ``megatron-gpu``, which
    assumes sequence parallelism) for ``shape`` at ``tp`` and context-parallel size ``cp`` (one CP rank's share)."""
    if derive not in _DERIVATIONS:
        raise ValueError(f"unknown memory derivation {derive!r} (known: {', '.join(_DERIVATIONS)}, {MEASURED_MEMORY})")
    sp = {"sequence_parallel": sequence_parallel} if derive == "saved-tensors" else {}
    return _DERIVATIONS[derive](shape, tp, cp=cp, **sp)


def carry_measured_memory(memory: MemoryCoeffs, ref: ModelShape, ref_tp: int, shape: ModelShape, tp: int,
                          sequence_parallel: bool = False, cp: int = 1, ref_cp: int | None = None) -> MemoryCoeffs:
    """A measured memory block (``derive`` ``"measured"``), measured at shape ``ref`` and TP ``ref_tp``, carried to
    ``shape`` at ``tp``: each measured coefficient (:data:`MEASURED_COEFFS`) times the ratio of its ``basis`` count
    at ``shape`` over at ``ref`` (so the output head's bytes follow the vocabulary, a layer's its widths and the
    TP split), the coefficients the profiler does not measure as the ``basis`` counts them at ``shape``, and
    ``bwd_workspace``, ``kv_grad`` as measured. Where ``shape`` and ``tp`` are those measured, every ratio is 1:
    the coefficients as measured. A measured profile on another shape thus never keeps the measured bytes as
    they are, nor drops them for the analytic count: it keeps the measured excess over the count. ``cp``: the
    context-parallel size carried to, from ``ref_cp`` (default: ``cp``, the block already at it; the profiler
    measures at 1)."""
    old = derived_memory(memory.basis, ref, ref_tp, sequence_parallel, cp if ref_cp is None else ref_cp)
    new = derived_memory(memory.basis, shape, tp, sequence_parallel, cp)
    measured = {k: getattr(memory, k) * (new[k] / old[k] if old[k] else 1.0) for k in MEASURED_COEFFS}
    counted = {k: v for k, v in new.items() if k not in MEASURED_COEFFS + ALLOCATOR_COEFFS}
    return replace(memory, **counted, **measured)


def shape_memory(profile: Profile) -> Profile:
    """``profile`` with its activation coefficients re-derived for its own model shape (memory
    ``derive``), so a profile placed on another hidden / ffn / heads / vocab size scales its memory;
    unchanged when ``derive`` is empty (coefficients as given). A measured block (``"measured"``) holds for the
    profile's ``time_model`` (the shape the profiler measured, times and memory alike) and is carried from it
    (:func:`carry_measured_memory`)."""
    derive = profile.memory.derive
    if not derive:
        return profile
    if derive == MEASURED_MEMORY:
        return replace(profile, memory=carry_measured_memory(profile.memory, profile.time_model, profile.tp, profile.model,
                                                             profile.tp, profile.sequence_parallel, profile.cp))
    memory = derived_memory(derive, profile.model, profile.tp, profile.sequence_parallel, profile.cp)
    return replace(profile, memory=replace(profile.memory, **memory))


def time_scale_factors(ref: ModelShape, shape: ModelShape) -> dict[str, float]:
    """Factors that carry per-layer time coefficients measured at shape ``ref`` to ``shape``, from
    FLOPs (same device, same tensor-parallel size, same kernels assumed):

    * ``a2`` (per token): the layer's GEMM FLOPs per token, ``2 (h (h + 2 h_kv) + h^2 + k h f)``
      (QKV, output projection, MLP with ``k`` = 2, or 3 with SwiGLU; ``h_kv`` the K/V heads' width with
      grouped-query attention; with ``kv_channels`` the query width ``heads x head_dim`` in place of
      ``h`` where it applies): everything per token that is not a GEMM (layernorms, biases, activation, residuals, RoPE; linear in ``h``) is lumped in;
    * ``a1``, ``a1c`` (per key-query pair): ``4 heads d`` FLOPs per pair (``Q K^T`` and ``P V`` over all
      query heads, whatever the K/V heads: grouped-query attention shares K/V, not the products), so
      ``q_hidden = heads x head_dim`` (``h`` without ``kv_channels``); the per-pair softmax and mask
      work per head is lumped in;
    * ``ac`` (per prefix token; fitted when the prefix K/V were copied before the attention call): ``h_kv``;
    * ``bs``, ``b1`` (per segment, per chunk: launches, Python): unchanged;
    * the output head's ``a2``: the logits GEMM, ``h * vocab`` (the softmax over ``vocab`` lumped in).
    """
    return {
        "a2": shape.gemm_flops_per_token() / ref.gemm_flops_per_token(),
        "a1": shape.q_hidden / ref.q_hidden,
        "ac": shape.kv_hidden / ref.kv_hidden,
        "head": shape.hidden * shape.vocab / (ref.hidden * ref.vocab),
    }


def shape_time(profile: Profile) -> Profile:
    """``profile`` with its time coefficients carried from the shape they were measured at
    (``time_model``) to its model shape by :func:`time_scale_factors`; the profile itself when the
    two agree in every field the time depends on (layer count and name do not count, nor the dropout
    probabilities: the masks' time is not modelled, the driver's online calibration absorbs it).

    First-principles FLOP scaling: a device's efficiency depends on the size of the GEMMs (small
    ones run further from peak), so a shape far from ``time_model`` is better profiled afresh
    (``scripts/profile_layer.py --hidden ...``). An analytic profile's ``a2`` is split as
    :func:`analytic_profile` builds it (GEMMs, backward twice the forward, at the head's ms per FLOP;
    the rest is tensor-parallel communication, scaled with ``h``): the result equals a fresh
    analytic profile of the new shape.
    """
    ref, shape = profile.time_model, profile.model
    same = {"name": shape.name, "num_layers": shape.num_layers, "hidden_dropout": shape.hidden_dropout,
            "attention_dropout": shape.attention_dropout}  # what the times do not depend on
    if ref is None or replace(ref, **same) == shape:
        return profile
    k = time_scale_factors(ref, shape)
    # analytic profiles: a2 = GEMM FLOPs x (ms per FLOP, read off the head's logits GEMM) + the
    # tensor-parallel communication per token, which scales with h, not with the FLOPs
    ms_per_flop = profile.head_fwd.a2 / (2.0 * ref.hidden * ref.vocab) if profile.source == "analytic" else None

    def linear(a2: float, gemm_passes: float) -> float:
        if ms_per_flop is None:
            return a2 * k["a2"]
        gemm = gemm_passes * ref.gemm_flops_per_token() * ms_per_flop
        return gemm * k["a2"] + (a2 - gemm) * shape.hidden / ref.hidden

    def layer(t: TimeCoeffs, passes: float = 1.0) -> TimeCoeffs:
        return replace(t, a1=t.a1 * k["a1"], a1c=t.a1c * k["a1"], a2=linear(t.a2, passes), ac=t.ac * k["ac"])

    def head(t: TimeCoeffs) -> TimeCoeffs:
        return replace(t, a1=t.a1 * k["a1"], a1c=t.a1c * k["a1"], a2=t.a2 * k["head"], ac=t.ac * k["ac"])

    return replace(
        profile, fwd=layer(profile.fwd), bwd=layer(profile.bwd, 2.0), recompute=layer(profile.recompute),
        head_fwd=head(profile.head_fwd), head_bwd=head(profile.head_bwd), time_model=shape,
    )


# ``--epp-profile cpu``: the shipped CPU profiles (``PROFILE_DIR/*_cpu.json``, each measured by
# ``scripts/profile_layer.py`` and calibrated by ``scripts/calibrate_step.py`` on this project's 2-core machines),
# the one measured nearest the model that runs (:func:`nearest_cpu_profile`)
CPU_PROFILES = "cpu"
# ``--epp-profile auto`` (the default): on CUDA a profile measured on this GPU for this dtype, attention kernel and
# layer shape (the cache, a shipped one, or measured at start-up: ``megatron_epp.training.profiling``); on the
# CPU, ``cpu``. ``--epp-profile analytic``: the analytic (FLOPs / peak x MFU) profile of the model's own shape
AUTO_PROFILE = "auto"
ANALYTIC_PROFILE = "analytic"
TEST_MODEL_PROFILE = PROFILE_DIR / f"{TEST_MODEL.name}_cpu.json"  # ``--epp-profile test-model``: hidden 64
PROFILE_NAMES = (AUTO_PROFILE, ANALYTIC_PROFILE, CPU_PROFILES, TEST_MODEL.name, *MODEL_PRESETS)
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "float32": "float32"}


def is_cpu_profile(profile: Profile) -> bool:
    """Measured on a CPU (``scripts/profile_layer.py``, or ``scripts/profile_gpu.py --device cpu``): its
    device names the CPU. Such a profile predicts a GPU's step hundreds of times too slow."""
    return profile.source == "measured" and profile.device.startswith("CPU ")


@dataclass(frozen=True)
class ProfileKey:
    """What a measured GPU profile is valid for: the GPU's name, the activations' dtype, the attention kernel
    the executor runs there, the torch version (its kernels), the context cap (``--seq-length``: the start-up
    profiler's grid is drawn from it) and the layer's shape as far as its time and memory depend on it (widths,
    heads, K/V heads, head dimension, MLP, norm, biases, positions). Layers, vocabulary and dropout are not in it:
    the profile is per layer, and the output head is carried to another vocabulary (its time by FLOPs,
    :func:`shape_time`; its measured bytes by the basis count, :func:`carry_measured_memory`).

    A profile records its key's torch version and context cap in ``fit["torch"]`` and ``fit["seq_length"]``;
    one written before 2026-11-27 has no cap (an older key format): it is no key's profile, and
    ``--epp-profile auto`` measures afresh (:func:`find_measured_profile` lists it as ignored)."""

    gpu: str
    dtype: str
    kernel: str
    torch: str
    seq_length: int
    layer: tuple

    @classmethod
    def of(cls, gpu: str, dtype: str, kernel: str, shape: ModelShape, torch: str, seq_length: int) -> "ProfileKey":
        layer = (shape.hidden, shape.num_heads, shape.ffn_hidden, shape.num_kv_heads or shape.num_heads, shape.head_dim,
                 shape.swiglu, shape.rope, shape.normalization, shape.bias)
        return cls(gpu, DTYPE_NAMES.get(dtype, dtype), kernel, torch, int(seq_length), layer)

    @classmethod
    def from_profile(cls, profile: Profile) -> "ProfileKey | None":
        """The key of a measured GPU profile, read off its ``device`` (``"GPU name (dtype, kernel)"``, as
        ``scripts/profile_gpu.py`` and the start-up profiler write it), its ``fit``'s torch version and context cap,
        and the shape its times were measured at; None for a CPU or an analytic profile, or one of the older key
        format (:func:`is_older_key_format`)."""
        match = re.fullmatch(r"(.+) \(([^,()]+), ([^,()]+)\)", profile.device)
        if profile.source != "measured" or is_cpu_profile(profile) or match is None or is_older_key_format(profile):
            return None
        return cls.of(match[1], match[2], match[3], profile.time_model, str(profile.fit["torch"]), int(profile.fit["seq_length"]))

    def file_name(self) -> str:
        """The cache file of this key: readable parts, and a digest of the whole key."""
        digest = hashlib.sha1(repr(self).encode()).hexdigest()[:10]
        gpu = re.sub(r"[^a-z0-9]+", "-", self.gpu.lower()).strip("-")
        return f"{gpu}_{self.dtype}_{self.kernel}_h{self.layer[0]}_s{self.seq_length}_{digest}.json"

    def describe(self) -> str:
        h, heads, ffn, kv_heads, d, swiglu, rope, norm, bias = self.layer
        return (f"{self.gpu}, {self.dtype}, {self.kernel}, torch {self.torch}, cap {self.seq_length}, hidden {h}, {heads} heads "
                f"({kv_heads} K/V) x {d}, ffn {ffn}{' SwiGLU' if swiglu else ''}, {norm}{'' if bias else ', no biases'}"
                f"{'' if rope else ', learned positions'}")


def is_older_key_format(profile: Profile) -> bool:
    """A measured GPU profile written before its key held the torch version and the context cap (2026-11-27): no
    ``fit["torch"]`` or ``fit["seq_length"]``."""
    return not is_cpu_profile(profile) and profile.source == "measured" and not {"torch", "seq_length"} <= set(profile.fit)


def default_profile_cache() -> Path:
    """``--epp-profile-cache``'s default: ``$XDG_CACHE_HOME/megatron-epp/profiles`` (``~/.cache`` without it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-epp" / "profiles"


def find_measured_profile(key: ProfileKey, cache_dir: str | Path | None,
                          older: list[Path] | None = None) -> tuple[Path, Profile] | None:
    """The measured GPU profile of ``key``: the cache's own file for it, any other profile in the cache with
    that key (``scripts/profile_gpu.py --out`` placed there), else a shipped one (``PROFILE_DIR``); None if none.
    Profiles of the older key format (:func:`is_older_key_format`) are no match; their paths go to ``older``."""
    cache = Path(cache_dir) if cache_dir is not None else None
    candidates = [cache / key.file_name()] if cache is not None else []
    candidates += sorted(cache.glob("*.json")) if cache is not None and cache.is_dir() else []
    candidates += [p for p in sorted(PROFILE_DIR.glob("*.json")) if not p.name.endswith("_cpu.json")]
    for path in dict.fromkeys(candidates):
        if not path.is_file():
            continue
        try:
            profile = Profile.load(path)
        except (ValueError, OSError, KeyError, TypeError):
            continue  # not a profile (or a torn file from before writes were atomic): not a match
        if ProfileKey.from_profile(profile) == key:
            return path, profile
        if older is not None and is_older_key_format(profile):
            older.append(path)
    return None


def check_profile_device(profile: Profile, spec: str, device: str) -> None:
    """A ``ValueError`` (one line, with the way out) for a CPU-measured profile on a GPU run: its times are a
    CPU's, hundreds of times a GPU's, and the planner would split what it should pack."""
    if device == "cuda" and is_cpu_profile(profile):
        raise ValueError(f"--epp-profile {spec}: measured on {profile.device}, this run is on CUDA; use --epp-profile "
                         f"{AUTO_PROFILE} (a profile measured on this GPU), {ANALYTIC_PROFILE}, or a GPU profile "
                         "(scripts/profile_gpu.py --out FILE)")


def shape_distance(a: ModelShape, b: ModelShape) -> tuple[int, float]:
    """How far apart two shapes are for the time coefficients: the architecture choices that differ
    (MLP, positions, norm, biases, dtype, grouped-query attention), then ``sum |log ratio|`` of the widths
    (hidden, FFN, query width, K/V width). Layers and vocabulary do not count (per layer; the head scales)."""
    kinds = sum(getattr(a, f) != getattr(b, f) for f in ("swiglu", "rope", "normalization", "bias", "dtype"))
    kinds += (a.num_kv_heads is None) != (b.num_kv_heads is None)
    widths = ((a.hidden, b.hidden), (a.ffn_hidden, b.ffn_hidden), (a.q_hidden, b.q_hidden), (a.kv_hidden, b.kv_hidden))
    return kinds, float(sum(abs(np.log(x / y)) for x, y in widths))


def nearest_cpu_profile(shape: ModelShape | None) -> Profile:
    """The shipped CPU profile measured nearest ``shape`` (:func:`shape_distance`; ties: file name), the
    test model's (``test-model_cpu.json``) without a shape. The planner then scales its times to ``shape``
    by FLOPs (:func:`shape_time`), which is exact at the shape it was measured at and drifts away from it
    (at hidden 128, hidden-64 coefficients over-predict real chunks by 8-40 %: docs/planner.md)."""
    if shape is None:
        return Profile.load(TEST_MODEL_PROFILE)
    profiles = [(path.name, Profile.load(path)) for path in sorted(PROFILE_DIR.glob("*_cpu.json"))]
    return min(profiles, key=lambda item: (shape_distance(item[1].time_model, shape), item[0]))[1]


def load_profile(spec: str, tp: int = 8, shape: ModelShape | None = None, device: str = "cpu") -> Profile:
    """A preset name (``llama-7b``/``llama-13b``/``llama-30b``: analytic H100 profile at ``tp``), ``analytic``
    (the analytic H100 profile of ``shape`` at ``tp``), ``cpu`` (the shipped CPU profile nearest ``shape``, the
    model that runs), ``test-model`` (the shipped CPU profile of the test model, hidden 64), ``auto`` (``cpu`` on
    the CPU; on CUDA resolved by the training driver, which measures: an error here) or a profile JSON path.
    ``device``: where the run is (``cpu``/``cuda``); a CPU-measured profile on ``cuda`` is an error."""
    if spec in MODEL_PRESETS:
        return analytic_profile(MODEL_PRESETS[spec], tp)
    if spec == ANALYTIC_PROFILE:
        if shape is None:
            raise ValueError(f"--epp-profile {ANALYTIC_PROFILE}: needs the model's shape (pretrain_gpt.py; epp-plan takes a preset)")
        return analytic_profile(shape, tp)
    if spec == AUTO_PROFILE and device == "cuda":
        raise ValueError(f"--epp-profile {AUTO_PROFILE} on CUDA: the profile is measured on the GPU at start-up "
                         "(megatron_epp.training.profiling), not loaded")
    if spec in (CPU_PROFILES, AUTO_PROFILE):
        profile = nearest_cpu_profile(shape)
    elif spec == TEST_MODEL.name:
        profile = Profile.load(TEST_MODEL_PROFILE)
    else:
        path = Path(spec)
        if not path.exists():
            raise ValueError(f"--epp-profile {spec!r}: not a preset ({', '.join(PROFILE_NAMES)}) nor a file")
        profile = Profile.load(path)
    check_profile_device(profile, spec, device)
    return profile


def profile_at_tp(profile: Profile, tp: int) -> tuple[Profile, str | None]:
    """``profile`` used at tensor-parallel size ``tp`` (``epp-plan --tp``, ``pretrain_gpt.py``'s
    ``--tensor-model-parallel-size``), and a one-line note when that is not the size it was measured at: the
    activation memory is then re-derived for ``tp`` (:func:`shape_memory`, by the memory ``derive``; a measured one
    carried by its basis count's ratio, :func:`carry_measured_memory`), the times
    are kept as measured, neither split over the ``tp`` ranks nor charged their collectives (off by a speed
    factor, which the driver's online calibration fits). A profile whose memory coefficients cannot be
    re-derived (no ``derive``) is only usable at its own size: a ``ValueError``."""
    if tp == profile.tp:
        return profile, None
    if not profile.memory.derive:
        raise ValueError(f"the profile {profile.device!r} was measured at TP={profile.tp} and its activation memory "
                         f"cannot be re-derived for TP={tp} (no memory 'derive')")
    if profile.memory.derive == MEASURED_MEMORY:  # carried to tp now: a measured block holds at the profile's own tp
        profile = replace(profile, memory=carry_measured_memory(profile.memory, profile.time_model, profile.tp,
                                                                profile.time_model, tp))
    return replace(profile, tp=tp), (f"the profile {profile.device!r} was measured at TP={profile.tp}; at TP={tp} its "
                                     "activation memory is re-derived, its times are as measured (not split over the "
                                     "tensor-parallel ranks: off by a speed factor)")
