"""The cost model (docs/planner.md, "Time model" and "Activation memory model") evaluated for many chunks at once with numpy.

A chunk is reduced to its feature vector (:mod:`.features`); every time and memory quantity is a dot
product of features with a profile's coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from megatron_epp.plan import split_layers
from megatron_epp.cost.features import F, padded_features
from megatron_epp.cost.host import HostLink
from megatron_epp.cost.network import NETWORKS, Network
from megatron_epp.cost.activation_memory import shape_memory
from megatron_epp.cost.analytic import shape_time
from megatron_epp.cost.profile import Profile, StageOverhead, TimeCoeffs


def default_network(profile: Profile) -> Network:
    """The network a cost model of ``profile`` uses unless given one: ``fat-tree`` for an analytic profile, else
    ``cpu-local`` (processes on one host)."""
    return NETWORKS["fat-tree" if profile.source == "analytic" else "cpu-local"]


@dataclass
class ChunkCosts:
    """Per-stage time (ms) and per-layer memory (bytes) of a list of chunks."""

    fwd: np.ndarray  # (P, n) forward time on each stage
    bwd: np.ndarray  # (P, n) backward time without recompute
    rc_layer: np.ndarray  # (n,) recompute time of one layer
    act_layer: np.ndarray  # (n,) activations of one non-checkpointed layer (K/V buffers apart)
    ckpt_layer: np.ndarray  # (n,) what one checkpointed layer keeps
    rc_input: np.ndarray  # (n,) what a recomputing layer holds beside its saved tensors and its kept input (0: they share it)
    kv_layer: np.ndarray  # (n,) one layer's K/V buffer rows of the chunk's slice (all its tokens if C = 0: a first slice)
    lone_layer: np.ndarray  # (n,) what one layer of a one-segment chunk does not save if it is a slice
    logits: np.ndarray  # (n,) held by the output head on the last stage
    embed: np.ndarray  # (n,) held by the embedding on the first stage
    workspace: np.ndarray  # (n,) extra bytes during the chunk's backward on a stage
    kv_grad: float  # a split sequence's K/V gradient accumulators per byte of its K/V buffer (0: not counted)
    p2p_ms: np.ndarray  # (n,) stage-to-stage transfer time of the chunk's activations
    tokens: np.ndarray  # (n,)


class CostModel:
    """A profile placed on ``P`` pipeline stages (``layers_per_stage``, even split by default), with
    ``dp`` data-parallel replicas (optimizer-state sharding) and a network for stage-to-stage sends.

    ``speed_factor`` ``s``: this machine's time over the profile's (measured = ``s`` x modelled), applied
    to every time (layers, the profile's per-chunk overhead, transfers); 1 is the machine the profile
    was taken on. Fitted on measured steps with the overhead (:mod:`megatron_epp.planner.calibration`).
    ``host``: the node's host memory and copy bandwidth (:class:`~megatron_epp.cost.host.HostLink`), which activation
    offload plans on; None: offload cannot be planned.
    """

    def __init__(
        self,
        profile: Profile,
        num_stages: int,
        layers_per_stage: Sequence[int] | None = None,
        dp: int = 1,
        network: Network | None = None,
        speed_factor: float = 1.0,
        host: HostLink | None = None,
    ) -> None:
        self.profile = shape_time(shape_memory(profile))  # activation memory and time for this model shape
        self.num_stages = num_stages
        self.layers = np.asarray(
            layers_per_stage if layers_per_stage is not None else split_layers(profile.model.num_layers, num_stages)
        )
        self.dp = dp
        self.network = network or default_network(profile)
        self.speed_factor = float(speed_factor)
        self.host = host

    def calibrated(self, speed_factor: float, overhead: StageOverhead) -> "CostModel":
        """This model with another speed factor and per-chunk stage overhead (profile ms)."""
        return CostModel(replace(self.profile, overhead=overhead), self.num_stages, self.layers, self.dp, self.network,
                         speed_factor, self.host)

    # ----------------------------------------------------------------------------- time
    def layer_time(self, feats: np.ndarray, coeffs: TimeCoeffs) -> np.ndarray:
        return feats @ coeffs.vector()

    def work_vector(self) -> np.ndarray:
        """Coefficients of a chunk's forward + backward time on the whole model (all stages), ms."""
        p = self.profile
        return self.speed_factor * ((p.fwd.vector() + p.bwd.vector()) * self.layers.sum() + p.head_fwd.vector() + p.head_bwd.vector())

    def costs(self, feats: np.ndarray) -> ChunkCosts:
        """Time and memory of chunks of features ``feats``; each chunk padded to a multiple of ``tp`` tokens under
        sequence parallelism, times ``cp`` under context parallelism (time and activations count the padding; a split
        sequence's K/V buffer holds only its own tokens)."""
        p, m, s = self.profile, self.profile.memory, self.speed_factor
        own_tokens = feats[:, F.S]
        multiple = (p.tp if p.sequence_parallel else 1) * p.cp
        if multiple > 1:
            feats = padded_features(feats, multiple)
        L = self.layers[:, None].astype(float)
        last = (np.arange(self.num_stages) == self.num_stages - 1)[:, None]
        tokens = feats[:, F.S]
        area = feats[:, F.SQ] + feats[:, F.SC]
        context = feats[:, F.C]  # a chunk holds at most one slice with context: its length is sum(s*C) / sum(C)
        slice_tokens = np.divide(feats[:, F.SC], context, out=np.zeros_like(context), where=context > 0)
        act = m.act_token * tokens + m.act_area * area + m.act_context * context + m.act_slice * slice_tokens
        return ChunkCosts(
            # + the executor's per-chunk stage overhead (on the constant feature: 1 per chunk, 0 in bound_ms)
            fwd=s * (L * self.layer_time(feats, p.fwd) + last * self.layer_time(feats, p.head_fwd) + p.overhead.fwd_ms * feats[:, F.CHUNKS]),
            bwd=s * (L * self.layer_time(feats, p.bwd) + last * self.layer_time(feats, p.head_bwd) + p.overhead.bwd_ms * feats[:, F.CHUNKS]),
            rc_layer=s * self.layer_time(feats, p.recompute),
            act_layer=act,
            ckpt_layer=m.ckpt_token * tokens,
            rc_input=m.recompute_input_token * tokens,
            # which chunks are slices (a first slice has the features of a whole sequence) is the plan's
            # to say: the memory walk applies kv_layer and lone_layer to the slices of split sequences
            kv_layer=m.kv_token * np.where(context > 0, slice_tokens, own_tokens),
            lone_layer=np.where(feats[:, F.SEGMENTS] == 1, m.lone_slice_token * tokens, 0.0),
            logits=m.logits_token * tokens,
            embed=m.embed_token * tokens,
            workspace=m.bwd_workspace * act,
            kv_grad=m.kv_grad,
            p2p_ms=s * self.network.p2p_ms(m.p2p_token * tokens),
            tokens=tokens,
        )

    def bound_ms(self, lengths: np.ndarray) -> float:
        """A lower bound on the step time of every plan of ``lengths`` on this model: per stage, the
        least compute its layers can cost over every way of cutting the sequences into chunks, no
        bubbles, no recompute, no communication; the slowest stage.

        Per sequence of ``n`` tokens cut into slices ``s_i`` with prefixes ``C_i``: ``sum s_i = n``
        and ``sum s_i^2 + 2 sum s_i C_i = n^2``, so with ``Q = sum s_i^2`` in ``[n, n^2]`` its
        attention costs ``a1 Q + a1c (n^2 - Q) / 2``, linear in ``Q``: the cheaper end is taken (one
        chunk where ``a1c >= 2 a1``, as a causal kernel's; one-token slices where the kernel computes
        the whole rectangle, ``a1c ~ a1``). The per-prefix-token term is at least 0 (``sum C`` in
        ``[0, n (n - 1) / 2]``), a sequence has at least one segment, and the per-chunk constants
        (launches, the executor's overhead: what packing saves) count as 0; a negative coefficient
        counts at its most negative (every slice one token)."""
        n = np.asarray(lengths, dtype=float)
        p, s = self.profile, self.speed_factor
        last = np.arange(self.num_stages) == self.num_stages - 1

        def least(c: TimeCoeffs) -> float:  # the least total of one layer's (or the head's) time over chunkings
            quad = np.minimum(c.a1 * n * n, c.a1c * n * n / 2 + (c.a1 - c.a1c / 2) * n)
            prefix = min(c.ac, 0.0) * n * (n - 1) / 2
            segments = np.where(c.bs >= 0, c.bs, c.bs * n)
            chunks = min(c.b1, 0.0) * n
            return float((quad + c.a2 * n + prefix + segments + chunks).sum())

        per_stage = self.layers * (least(p.fwd) + least(p.bwd)) + last * (least(p.head_fwd) + least(p.head_bwd))
        overhead = min(p.overhead.fwd_ms + p.overhead.bwd_ms, 0.0) * n.sum()
        return float(s * (per_stage + overhead).max())

    # ----------------------------------------------------------------------------- memory
    def model_state_bytes(self) -> np.ndarray:
        """Weights, gradients and optimizer states per GPU of every stage (``ModelShape.rank_parameters``:
        embedding on the first stage, final norm and output layer on the last), the optimizer's divided
        over the data-parallel ranks with a distributed optimizer: as megatron-core holds them under context
        parallelism (``profile.cp``), weights and gradients replicated over the CP ranks, the optimizer sharded over
        DP x CP."""
        m = self.profile.memory
        optim = m.optim / (self.dp * self.profile.cp if m.distributed_optimizer else 1)
        return self.profile.model.rank_parameters(self.layers, self.profile.tp) * (m.weight + m.grad + optim)
