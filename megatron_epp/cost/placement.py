"""A cost profile placed on a parallel layout: :func:`place_profile`, the one function that fits a profile to a stage's
tensor- and context-parallel sizes. Every user of a profile on a layout goes through it: ``epp-plan`` (``--tp``), the
layout search (each candidate ``tp x cp``), the online planner (the run's ``cp``) and the training driver's profile
resolution (the run's ``tp``); :func:`placement_note` is the one-line note of a profile used at another TP size.

A profile comes from its source at some ``tp`` and at ``cp`` 1: measured (``epp-profile-gpu``, the start-up
profiler, the shipped CPU profiles) or analytic (:func:`~megatron_epp.cost.analytic.analytic_profile`, built at the
``tp`` asked for). Placing it:

* at ``tp`` other than its own: its activation memory is re-derived for ``tp`` (:func:`shape_memory` at the
  cost model, by the memory ``derive``; a measured block carried by its basis count's ratio now,
  :func:`carry_measured_memory`); its times are kept as measured, neither split over the ``tp`` ranks nor charged
  their collectives (off by a speed factor, which the driver's online calibration fits). A profile whose memory
  cannot be re-derived (no ``derive``) is only usable at its own size: a ``ValueError``;
* at ``cp`` > 1 (Ulysses all-to-all): first carried to its model shape (:func:`shape_time`, :func:`shape_memory`:
  the all-to-alls' time is not carried by FLOPs), then each GPU's share of the compute and the all-to-alls on the
  network (:func:`_at_cp`).
"""

from __future__ import annotations

from dataclasses import replace

from megatron_epp.base.dims import ParallelDims
from megatron_epp.cost.activation_memory import MEASURED_MEMORY, carry_measured_memory, derived_memory, shape_memory
from megatron_epp.cost.analytic import shape_time
from megatron_epp.cost.model import default_network
from megatron_epp.cost.network import Network
from megatron_epp.cost.profile import Profile, TimeCoeffs
from megatron_epp.cost.shape import DTYPE_BYTES, check_context_parallel, kv_heads_split


def place_profile(profile: Profile, dims: ParallelDims, network: Network | None = None) -> Profile:
    """``profile`` as one GPU of a pipeline stage of layout ``dims`` sees it: at ``dims.tp``, then at ``dims.cp`` with
    its all-to-alls on ``network`` (default: :func:`~megatron_epp.cost.model.default_network` of the profile); the
    module docstring says how. ``dims.pp`` and ``dims.dp`` do not enter (the cost model's); ``dims.sequence_parallel``
    neither (the profile's own flag counts). The profile itself where it is at ``dims.tp`` and ``dims.cp`` is 1."""
    profile = _at_tp(profile, dims.tp)
    if dims.cp == 1:
        return profile
    return _at_cp(shape_time(shape_memory(profile)), dims.cp, network or default_network(profile))


def placement_note(profile: Profile, dims: ParallelDims) -> str | None:
    """The one-line note of ``profile`` placed at ``dims`` (:func:`place_profile`) when ``dims.tp`` is not the TP
    size it was measured at (its times are not split over the ranks); None otherwise."""
    if dims.tp == profile.tp:
        return None
    return (f"the profile {profile.device!r} was measured at TP={profile.tp}; at TP={dims.tp} its activation memory is "
            "re-derived, its times are as measured (not split over the tensor-parallel ranks: off by a speed factor)")


def _at_tp(profile: Profile, tp: int) -> Profile:
    """``profile`` at tensor-parallel size ``tp`` (the module docstring)."""
    if tp == profile.tp:
        return profile
    if not profile.memory.derive:
        raise ValueError(f"the profile {profile.device!r} was measured at TP={profile.tp} and its activation memory "
                         f"cannot be re-derived for TP={tp} (no memory 'derive')")
    if profile.memory.derive == MEASURED_MEMORY:  # carried to tp now: a measured block holds at the profile's own tp
        profile = replace(profile, memory=carry_measured_memory(profile.memory, profile.time_model, profile.tp,
                                                                profile.time_model, tp))
    return replace(profile, tp=tp)


def _at_cp(profile: Profile, cp: int, network: Network) -> Profile:
    """``profile`` (one GPU of a stage at its ``tp``, at its model shape) placed at context-parallel size ``cp`` > 1
    (Ulysses all-to-all, ``--context-parallel-size cp --cp-comm-type a2a``; ``cp`` divides the heads of a TP rank).

    Time: each GPU runs its ``1 / cp`` of a chunk's tokens through the linear layers (and their tensor-parallel
    collectives) and every token for ``heads / cp`` of the heads in core attention, so the per-token, per-pair and
    per-prefix-token coefficients (layers and output head) are divided by ``cp``; the per-segment and per-chunk
    launches are not. Per layer and chunk the forward pays 4 all-to-alls over the ``cp`` GPUs (q, k, v in, the
    output back), the backward the same 4 (their gradients), a recompute the forward's again: per token of the chunk
    a GPU holds ``b (2 q + 2 h_kv) / tp / cp`` bytes of them (``b``: the shape's activation bytes), of which
    :meth:`Network.alltoall_ms` sends ``(cp-1)/cp``; K and V replicated (``cp`` not dividing the K/V heads of a TP
    rank, :func:`~megatron_epp.cost.shape.kv_heads_split`) are gathered whole, ``b 2 h_kv / tp`` per token. Not
    overlapped (core attention waits for them): their bytes go on the per-token term, their latencies on the
    per-chunk constant. Stage-to-stage sends carry ``1 / cp`` of the tokens per GPU (rank to rank, the same CP index).

    Memory: the activation coefficients of the profile's ``derive`` count at ``cp`` (a CP rank's share:
    :func:`~megatron_epp.cost.activation_memory.saved_tensor_memory`, :func:`~megatron_epp.cost.activation_memory.gpu_activation_memory`;
    a measured block carried there by its basis count); model states as megatron-core holds them: weights and
    gradients replicated over CP, the distributed optimizer sharded over DP x CP (:meth:`CostModel.model_state_bytes`
    reads ``profile.cp``). A profile without a ``derive`` cannot be re-derived: a ``ValueError``."""
    shape, tp = profile.model, profile.tp
    check_context_parallel(shape, tp, cp)
    if profile.cp != 1:
        raise ValueError(f"the profile {profile.device!r} is already at context-parallel size {profile.cp}")
    if not profile.memory.derive:
        raise ValueError(f"the profile {profile.device!r}: its activation memory cannot be re-derived for context "
                         "parallelism (no memory 'derive')")
    b = DTYPE_BYTES[shape.dtype]
    kv = shape.kv_hidden / tp / (cp if kv_heads_split(shape, tp, cp) else 1)
    per_token = b * (2 * shape.q_hidden / tp / cp + 2 * kv)  # q, output; k, v: bytes per token of the chunk, per GPU
    latency = network.alltoall_ms(0.0, cp)
    a2a_token = network.alltoall_ms(per_token * 1e6, cp) / 1e6 - latency / 1e6  # ms per token (linear in the bytes)
    a2a_chunk = 4 * latency  # ms per layer and chunk

    def layer(t: TimeCoeffs) -> TimeCoeffs:
        return TimeCoeffs(t.a1 / cp, t.a1c / cp, t.a2 / cp + a2a_token, t.ac / cp, t.bs, t.b1 + a2a_chunk)

    def head(t: TimeCoeffs) -> TimeCoeffs:
        return TimeCoeffs(t.a1 / cp, t.a1c / cp, t.a2 / cp, t.ac / cp, t.bs, t.b1)

    if profile.memory.derive == MEASURED_MEMORY:
        memory = carry_measured_memory(profile.memory, profile.time_model, tp, profile.time_model, tp, profile.sequence_parallel,
                                       cp=cp, ref_cp=1)
    else:
        memory = replace(profile.memory, **derived_memory(profile.memory.derive, shape, tp, profile.sequence_parallel, cp))
    return replace(
        profile, cp=cp, fwd=layer(profile.fwd), bwd=layer(profile.bwd),
        recompute=layer(profile.recompute), head_fwd=head(profile.head_fwd), head_bwd=head(profile.head_bwd),
        memory=replace(memory, p2p_token=profile.memory.p2p_token / cp),
    )
