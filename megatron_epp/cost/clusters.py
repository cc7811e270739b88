"""Cluster presets named after real machines, their collectives, and the per-stage profile of a
parallel layout (tensor parallelism x context parallelism, Ulysses all-to-all, inside a node).

A :class:`Cluster` is ``num_nodes`` nodes of ``gpus_per_node`` GPUs: an :class:`Accelerator` (peak
bf16 dense TFLOP/s), its memory, NVLink inside a node and InfiniBand between nodes. Bandwidths are
per GPU and per direction, GB/s. Every figure below cites its source; the papers we compare with
(InfiniPipe, FlexSP) state "400 Gb/s InfiniBand" without saying per node or per GPU, so both
readings are presets: ``*-ib-node`` (400 Gb/s shared by the node's 8 GPUs: 6.25 GB/s each) and
``*-ib-gpu`` (400 Gb/s per GPU: 50 GB/s each, a DGX-style rail per GPU).

Collectives (one model for every system, stated in docs/baselines.md):

* all-to-all in a group of ``g`` GPUs: a GPU sends ``(g-1)/g`` of its bytes; the part to GPUs of its
  own node goes over NVLink, the rest over its InfiniBand share, both at once (the slower decides);
* all-gather / reduce-scatter of ``n`` bytes over ``g`` GPUs (ring, one channel per GPU's rail): each
  GPU moves ``(g-1)/g * n``; within a node at NVLink speed, across nodes at the node's InfiniBand
  (``gpus_per_node`` x the per-GPU share), whichever is slower;
* overlap: a collective that can run behind compute (ZeRO-3/FSDP gathers, gradient reduce-scatter,
  the data-parallel gradient sync) hides at most ``overlap`` of its time and at most the compute it
  runs behind: ``exposed = max((1 - overlap) * comm, comm - compute)`` (:func:`exposed_ms`); context
  parallelism's all-to-alls hide nothing (core attention waits for them: :func:`cp_profile`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from megatron_epp.cost.network import Network
from megatron_epp.cost.activation_memory import MEASURED_MEMORY, carry_measured_memory, derived_memory
from megatron_epp.cost.analytic import Accelerator, analytic_profile
from megatron_epp.cost.profile import Profile, TimeCoeffs
from megatron_epp.cost.profile_lookup import PROFILE_DIR
from megatron_epp.cost.shape import DTYPE_BYTES, ModelShape, check_context_parallel, kv_heads_split

# Fraction of a collective's time hidden behind compute where it can overlap (ZeRO-3 / FSDP parameter
# gathers and gradient reduce-scatters, the data-parallel gradient sync). The same 0.5 as the analytic
# profile's tensor-parallel overlap (Accelerator.tp_overlap); a parameter of every baseline alike.
COMM_OVERLAP = 0.5

# NVIDIA A800 SXM4 80GB: "NVIDIA A800 Tensor Core GPU" datasheet: BF16 Tensor Core 312 TFLOPS (624 with
# sparsity), 80 GB HBM2e, "NVIDIA NVLink 400GB/s" (bidirectional: 200 GB/s per direction).
A800 = Accelerator("A800-SXM4-80GB bf16", 312.0, tp_bw_gbps=200.0)
# NVIDIA H100 SXM5 80GB: "NVIDIA H100 Tensor Core GPU" datasheet: BF16 Tensor Core 1,979 TFLOPS with
# sparsity (989.5 dense), 80 GB HBM3, NVLink 900 GB/s (bidirectional: 450 GB/s per direction).
H100_SXM = Accelerator("H100-SXM5-80GB bf16", 989.5, tp_bw_gbps=450.0)

# InfiniBand: 400 Gb/s = 50 GB/s per port and direction (NDR, "NVIDIA ConnectX-7" adapter datasheet;
# the DGX H100 datasheet lists 8 single-port ConnectX-7 400 Gb/s, one per GPU). "400 Gb/s" per node
# shared by 8 GPUs is 50 / 8 = 6.25 GB/s per GPU.
IB_400G_GBPS = 50.0
NVLINK_LATENCY_US = 3.0  # order of NCCL's intra-node latency (a constant per collective; not a datasheet figure)
IB_LATENCY_US = 8.0  # order of NCCL's inter-node latency (idem)


@dataclass(frozen=True)
class Cluster:
    """``num_nodes`` x ``gpus_per_node`` GPUs; bandwidths per GPU and direction, GB/s."""

    name: str
    accelerator: Accelerator
    memory_gb: float
    gpus_per_node: int
    num_nodes: int
    nvlink_gbps: float
    ib_gbps: float  # InfiniBand share of one GPU
    description: str = ""

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes

    def with_nodes(self, num_nodes: int, gpus_per_node: int | None = None) -> "Cluster":
        return replace(self, num_nodes=num_nodes, gpus_per_node=gpus_per_node or self.gpus_per_node)

    def network(self, span: int) -> Network:
        """The stage-to-stage network of a pipeline whose stages, ``span`` GPUs in all, sit one after
        another: NVLink when the pipeline fits in one node, else every hop at the InfiniBand share
        (pessimistic for hops inside a node). All-to-alls use :meth:`alltoall_ms`'s split."""
        intra = span <= self.gpus_per_node
        bw, lat = (self.nvlink_gbps, NVLINK_LATENCY_US) if intra else (self.ib_gbps, IB_LATENCY_US)
        return Network(self.name, bw, lat, self.ib_gbps, IB_LATENCY_US, self.nvlink_gbps, NVLINK_LATENCY_US,
                       self.gpus_per_node, description=self.description)

    def alltoall_ms(self, nbytes: float, group: int) -> float:
        return self.network(self.world_size).alltoall_ms(nbytes, group)

    def allgather_ms(self, nbytes: float, group: int) -> float:
        """All-gather (or reduce-scatter) of ``nbytes`` in all over ``group`` GPUs (consecutive ranks)."""
        if group <= 1:
            return 0.0
        moved = nbytes * (group - 1) / group
        if group <= self.gpus_per_node:
            return NVLINK_LATENCY_US * 1e-3 * (group - 1) + moved / (self.nvlink_gbps * 1e6)
        bw = min(self.nvlink_gbps, self.gpus_per_node * self.ib_gbps)
        return IB_LATENCY_US * 1e-3 * (group - 1) + moved / (bw * 1e6)

    def strided_allgather_ms(self, nbytes: float, group: int, stride: int) -> float:
        """All-gather over ``group`` GPUs ``stride`` ranks apart (a data-parallel group): inside a node
        when ``group * stride <= gpus_per_node``, else every GPU over its own InfiniBand share."""
        if group <= 1:
            return 0.0
        moved = nbytes * (group - 1) / group
        if group * stride <= self.gpus_per_node:
            return NVLINK_LATENCY_US * 1e-3 * (group - 1) + moved / (self.nvlink_gbps * 1e6)
        return IB_LATENCY_US * 1e-3 * (group - 1) + moved / (self.ib_gbps * 1e6)


def exposed_ms(comm_ms: float, compute_ms: float, overlap: float = COMM_OVERLAP) -> float:
    """The part of a collective not hidden behind ``compute_ms`` (module docstring)."""
    return max((1.0 - overlap) * comm_ms, comm_ms - compute_ms, 0.0)


def _preset(name: str, acc: Accelerator, nvlink: float, ib: float, what: str) -> Cluster:
    return Cluster(name, acc, 80.0, 8, 4, nvlink, ib, what)


CLUSTERS: dict[str, Cluster] = {
    c.name: c
    for c in (
        _preset("a800-ib-node", A800, 200.0, IB_400G_GBPS / 8, "4 x 8 A800 SXM4 80GB, NVLink 400 GB/s, 400 Gb/s IB per node"),
        _preset("a800-ib-gpu", A800, 200.0, IB_400G_GBPS, "4 x 8 A800 SXM4 80GB, NVLink 400 GB/s, 400 Gb/s IB per GPU"),
        _preset("h100-ib-node", H100_SXM, 450.0, IB_400G_GBPS / 8, "4 x 8 H100 SXM5 80GB, NVLink 900 GB/s, 400 Gb/s IB per node"),
        _preset("h100-ib-gpu", H100_SXM, 450.0, IB_400G_GBPS, "4 x 8 H100 SXM5 80GB, NVLink 900 GB/s, 400 Gb/s IB per GPU (DGX H100)"),
    )
}


def get_cluster(name: str) -> Cluster:
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster {name!r}; presets: {', '.join(CLUSTERS)}")
    return CLUSTERS[name]


def measured_profile_path(shape: ModelShape, cluster: Cluster, tp: int) -> Path:
    """Where a measured GPU profile of this shape, device and TP size would be (``python -m megatron_epp.measure.profile_gpu --out``)."""
    device = cluster.accelerator.name.split()[0].lower()
    return PROFILE_DIR / f"{shape.name}_{device}_tp{tp}.json"


def tp_profile(shape: ModelShape, cluster: Cluster, tp: int) -> Profile:
    """A stage of ``tp`` tensor-parallel GPUs: the measured profile where one exists, else analytic."""
    path = measured_profile_path(shape, cluster, tp)
    if path.exists():
        return replace(Profile.load(path), model=shape)
    return analytic_profile(shape, tp, cluster.accelerator)


def cp_profile(profile: Profile, cp: int, network: Network) -> Profile:
    """``profile`` (one GPU of a stage at its ``tp``) placed at context-parallel size ``cp`` (Ulysses all-to-all,
    ``--context-parallel-size cp --cp-comm-type a2a``; ``cp`` must divide the heads of a TP rank): the profile itself
    at ``cp`` = 1.

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
    if cp == 1:
        return profile
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


def stage_profile(shape: ModelShape, cluster: Cluster, tp: int, cp: int, pipeline_span: int) -> Profile:
    """The per-GPU profile of one pipeline stage of ``tp x cp`` GPUs (inside a node): :func:`tp_profile` placed at
    ``cp`` (:func:`cp_profile`) on the cluster's links (the CP group inside the node: NVLink)."""
    if tp * cp > cluster.gpus_per_node:
        raise ValueError(f"a stage of TP={tp} x CP={cp} GPUs: more than the node's {cluster.gpus_per_node}")
    return cp_profile(tp_profile(shape, cluster, tp), cp, cluster.network(pipeline_span))
