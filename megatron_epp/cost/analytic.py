"""Time from FLOPs: the analytic GPU profile of a model shape (FLOPs / peak x MFU, :func:`analytic_profile`), and
the FLOP scaling that carries a profile's time coefficients to another shape (:func:`shape_time`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_epp.cost.activation_memory import gpu_activation_memory
from megatron_epp.cost.profile import MemoryCoeffs, Profile, TimeCoeffs
from megatron_epp.cost.shape import ModelShape


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
    bwd = TimeCoeffs(2.5 * a1, 5 * a1, 2 * shape.gemm_flops_per_token() * ms_per_gemm_flop + comm + tiled_mlp_recompute(shape, ms_per_gemm_flop),
                     0.0, 0.0, 2 * acc.launch_ms)
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
        head_bwd=TimeCoeffs(0.0, 0.0, (2 + (shape.loss_chunk_tokens > 0)) * head, 0.0, 0.0, 0.0),  # + a chunked head's recomputed logits
        memory=memory,
        time_model=shape,
        fit={"note": f"analytic: peak {acc.peak_tflops} TFLOP/s, MFU {acc.mfu} (attention {acc.attn_mfu}), TP overlap {acc.tp_overlap}; not measured"},
    )


def tiled_mlp_recompute(shape: ModelShape, ms_per_gemm_flop: float | None = None, fwd_a2: float = 0.0) -> float:
    """Per token, the ms a tiled MLP's backward (``mlp_chunk_tokens``) adds to a layer's: one more MLP forward, its
    GEMMs at ``ms_per_gemm_flop`` (an analytic profile) or the MLP's share of the layer's forward GEMM FLOPs times the
    layer's forward ``fwd_a2`` (a measured one); 0 without the tiled MLP. Its tensor-parallel all-gather and
    reduce-scatter, recomputed too, are not charged."""
    if not shape.mlp_chunk_tokens:
        return 0.0
    if ms_per_gemm_flop is not None:
        return shape.mlp_gemm_flops_per_token() * ms_per_gemm_flop
    return fwd_a2 * shape.mlp_gemm_flops_per_token() / shape.gemm_flops_per_token()


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
    probabilities: the masks' time is not modelled, the driver's online calibration absorbs it). The chunked output
    head (``loss_chunk_tokens``) recomputes its logits in backward: carried to or from it, the head's backward gains
    or loses one head forward's ``a2``; the tiled MLP (``mlp_chunk_tokens``) its MLP: a layer's backward gains or
    loses one MLP forward (:func:`tiled_mlp_recompute`).

    First-principles FLOP scaling: a device's efficiency depends on the size of the GEMMs (small
    ones run further from peak), so a shape far from ``time_model`` is better profiled afresh
    (``python -m benchmarks.profile_layer --hidden ...``). An analytic profile's ``a2`` is split as
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

    head_bwd = head(profile.head_bwd)
    recomputed = (shape.loss_chunk_tokens > 0) - (ref.loss_chunk_tokens > 0)  # the chunked head's backward: + a forward
    if recomputed:
        head_bwd = replace(head_bwd, a2=head_bwd.a2 + recomputed * head(profile.head_fwd).a2)
    # the tiled MLP's recomputed forward in the backward: off at the measured shape's, carried, on at the new one's
    fwd = layer(profile.fwd)
    bwd = layer(replace(profile.bwd, a2=profile.bwd.a2 - tiled_mlp_recompute(ref, ms_per_flop, profile.fwd.a2)), 2.0)
    bwd = replace(bwd, a2=bwd.a2 + tiled_mlp_recompute(shape, ms_per_flop, fwd.a2))
    return replace(
        profile, fwd=fwd, bwd=bwd, recompute=layer(profile.recompute),
        head_fwd=head(profile.head_fwd), head_bwd=head_bwd, time_model=shape,
    )
