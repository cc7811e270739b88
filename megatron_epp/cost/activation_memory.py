"""Activation memory per layer and token, counted analytically for a model shape: Megatron's GPU count
(:func:`gpu_activation_memory`), the tensors autograd saves on the CPU (:func:`saved_tensor_memory`), a measured
block carried to another shape (:func:`carry_measured_memory`), and a profile's memory re-derived for its own shape
(:func:`shape_memory`). docs/planner.md, "Activation memory model", has the layout."""

from __future__ import annotations

from dataclasses import replace

from megatron_epp.cost.profile import MemoryCoeffs, Profile
from megatron_epp.cost.shape import DTYPE_BYTES, ModelShape, check_context_parallel, kv_heads_split


def gpu_activation_memory(shape: ModelShape, tp: int, cp: int = 1) -> dict[str, float]:
    """Megatron's activation count per layer and token (bf16 whatever the shape's dtype, sequence
    parallel, flash attention: no quadratic term), ``34 h / tp`` for a GPT layer: the attention's
    QKV input ``2 h``, Q ``2 q``, K and V ``2 * 2 h_kv``, the output projection's input ``2 q`` and a
    dropout mask ``h``; the MLP's fc1 input ``2 h``, activation input ``2 f`` (SwiGLU: fc1's whole
    output, ``4 f``), fc2 input ``2 f`` and a dropout mask ``h``; the two norms' inputs ``4 h``
    (``q = heads x head_dim``, ``h_kv`` the K/V heads' width: GQA saves smaller K and V); query and key norms
    (``--qk-layernorm``) their inputs ``2 q + 2 h_kv``, counted as the two norms are; the tiled MLP
    (``mlp_chunk_tokens``) keeps fc1's input alone (its blocks' activations are the backward's workspace). K and V are
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
    attention = 2 * h + 2 * q + 2 * q + h + (2 * q if cp > 1 else 0) + (2 * (q + shape.kv_hidden) if shape.qk_norm else 0)
    mlp = 2 * h + ((4 if shape.swiglu else 2) * f + 2 * f if not shape.mlp_chunk_tokens else 0) + h
    share = tp * cp  # the GPUs a chunk's tokens (outside core attention) or its heads (inside) are divided over
    return {
        "act_token": (attention + mlp + 4 * h) / share + kv, "act_area": 0.0, "act_context": 0.0, "ckpt_token": 2.0 * h / share,
        "kv_token": kv, "lone_slice_token": kv, "logits_token": head_kept_token(shape, 2.0 * h / share, 4.0 * shape.vocab / share, cp),
        "embed_token": h / share if shape.hidden_dropout > 0 else 0.0,
    }


# bytes a token the chunked head (``executor.chunked_loss``) keeps beside its input: its target (int32), its
# log-sum-exp (fp32), and the loss mask (fp32) the loss's product saves (as with the unchunked head), over all the
# tensor-parallel group's tokens (per context-parallel rank)
CHUNKED_HEAD_TOKEN = 12.0


def head_kept_token(shape: ModelShape, head_input: float, logits: float, cp: int) -> float:
    """What the output layer and the loss keep a token (the final norm's apart): ``logits`` (the unchunked head's
    fp32 softmax and the loss's targets and masks, as counted by the caller) with the whole chunk's logits, or with
    ``shape.loss_chunk_tokens`` (the chunked head) its input ``head_input`` (this rank's share, kept once under
    sequence parallelism) and :data:`CHUNKED_HEAD_TOKEN` per context-parallel share, never the logits. A block's
    logits in forward and backward are transient workspace (``loss_chunk_tokens x V / tp`` elements), not kept."""
    if not shape.loss_chunk_tokens:
        return logits
    return head_input + CHUNKED_HEAD_TOKEN / cp


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
    * the QKV linear: its input ``b h``; query and key norms (``--qk-layernorm``): :func:`_saved_qk_norms`;
    * attention (RoPE and SDPA): :func:`_saved_attention`;
    * the output projection's input ``b q``; fc1's input ``b h``; the MLP's activation: GELU its
      input ``b f`` and fc2's input ``b f``; SwiGLU (megatron-core's unfused ``glu``) fc1's whole
      output ``2 b f`` (SiLU's input is a view of it), SiLU's output, the linear half plus its offset
      (a new tensor) and fc2's input, ``b f`` each: ``5 b f``; the tiled MLP (``mlp_chunk_tokens``) none (workspace).

    Biases save nothing (``--disable-bias-linear``, ``--add-qkv-bias`` change no activation). A split sequence's K/V
    buffer holds ``2 b h_kv`` per token of the whole sequence and layer (``kv_token``: its K and V rows);
    each slice writes its K/V there and SDPA reads (and saves) the slice's rows ``[0, C + s)`` in place,
    so no copy of the prefix is saved (``act_context`` = ``act_slice`` = 0). In a chunk that is only a
    slice, the K after RoPE and the QKV output are then saved by nothing (``lone_slice_token``; without
    RoPE the query is a view of the QKV output, which stays saved). A checkpointed layer keeps its input
    (``b h``). The last stage keeps the final norm (as above), the output layer's input (``b h``), the
    fp32 softmax of the logits (``4 V``), the loss's target mask and indices (1 + 8) and the loss mask
    (4); the first stage the token ids (8; and position ids, 8, with learned positions; at tp > 1 the ids
    shifted to the rank's vocabulary share and the boolean mask of the ids outside it, 8 + 1).

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
    qk_norms, lone = _saved_qk_norms(shape, b, q, kv, heads, cp, lone)
    mask = b * H / sp if shape.hidden_dropout > 0 else 0.0  # a hidden dropout's mask (CPU: the scaled keep mask in b)
    per_token = (
        2 * norm  # the two norms
        + 2 * b * H / sp  # QKV linear and fc1 inputs
        + qk_norms
        + attention
        + b * q / cp  # output projection input
        + (0 if shape.mlp_chunk_tokens else 5 if shape.swiglu else 2) * b * f / cp  # the MLP's activation and fc2 inputs
        + 2 * mask  # the hidden dropouts after attention and after the MLP
    )
    return {
        "act_token": per_token, "act_area": area, "act_context": prefix, "act_slice": 0.0,
        "lone_slice_token": lone, "ckpt_token": b * H / sp, "kv_token": 2 * b * kv_rank,
        "logits_token": norm + head_kept_token(shape, b * H / sp, b * H / sp + (4 * shape.vocab / tp + 13) / cp, cp),
        "embed_token": ((8.0 if shape.rope else 16.0) + (tp > 1)) / cp + mask,  # + the embedding's dropout
        "bwd_workspace": 0.0,
        "kv_grad": 0.0,
        # the recomputed layer's first norm saves its input itself, except RMSNorm's fp32 copy of a bf16 input
        "recompute_input_token": b * H / sp if shape.normalization == "RMSNorm" and b != 4 else 0.0,
    }


def _saved_qk_norms(shape: ModelShape, b: float, q: float, kv: float, heads: float, cp: int, lone: float) -> tuple[float, float]:
    """What the query and key norms (``--qk-layernorm``, one norm over each head's ``head_dim`` channels, before RoPE,
    on the rank's own tokens) save per token of a chunk on one tensor-parallel rank (``q``, ``kv``, ``heads``: its
    share), and ``lone`` (:func:`_saved_attention`'s) corrected; (0, ``lone``) without them.

    Each norm saves as the layers' norms do (:data:`NORM_SAVED`), its statistics per head. RMSNorm: the fp32 input,
    the fp32 rstd and the fp32 normalised input; LayerNorm: the input, mean and rstd. A norm's input is a view of the
    QKV output for the keys in fp32, and for the queries in fp32 with one query head per K/V group or one K/V group on
    the rank (megatron-core's reshape of several groups' several query heads copies them); then the norm keeps the whole QKV output saved in every
    chunk: counted here where attention does not save it (context parallelism's all-to-alls, the math path's copied
    V), and no longer subtracted for a lone slice where it does. Without RoPE the flash kernel saves the norms'
    outputs as its q and k (new storages where they were views of the QKV output), a lone slice its q alone.
    Measured byte-exact by ``tests/integration/test_planner_memory.py`` (RMSNorm in fp32 and bf16, with one and
    several query heads per group, with both dropouts, at cp 2 and at tp 2 with sequence parallelism; LayerNorm with
    RoPE and with learned positions)."""
    if not shape.qk_norm:
        return 0.0, lone
    kv_heads = heads * kv / q
    saved = 0.0
    for width, count, view in ((q, heads, b == 4 and (heads == kv_heads or kv_heads == 1)), (kv, kv_heads, b == 4)):
        if shape.normalization == "RMSNorm":
            saved += (0.0 if view else 4 * width) + 4 * count + 4 * width
        else:
            saved += (0.0 if view else b * width) + 2 * b * count
    if not shape.rope and shape.attention_dropout == 0 and cp == 1:  # SDPA's q and k: the norms' outputs, not QKV views
        saved, lone = saved + b * (q + kv), lone + b * kv
    qkv = b * (q + 2 * kv)
    if b == 4:  # the keys' norm keeps the QKV output
        if cp > 1 or (shape.attention_dropout > 0 and kv != q):
            saved += qkv
        elif shape.rope or shape.attention_dropout > 0:
            lone -= qkv
    return saved / cp, lone


# fp32 tensors per head and query-key pair SDPA's CPU math path saves with dropout (saved_tensor_memory): the
# softmax's probabilities, the dropout's scaled keep mask, the dropped probabilities (the input of ``P V``)
MATH_SDPA_SAVED = 3

# bytes one norm saves per token, from the activations' bytes ``b`` and the hidden size (saved_tensor_memory)
NORM_SAVED = {
    "LayerNorm": lambda b, h: b * h + 2 * b,  # input; mean and rstd in the input's dtype
    "RMSNorm": lambda b, h: 8.0 * h + 4.0,  # fp32 input (a copy unless fp32), fp32 rstd, fp32 normalised input
}


_DERIVATIONS = {"saved-tensors": saved_tensor_memory, "megatron-gpu": gpu_activation_memory}
# ``MemoryCoeffs.derive`` of a memory block the start-up profiler measured (``measure.profiling.measure_profile``), and
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
