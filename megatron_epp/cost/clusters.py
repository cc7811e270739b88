"""Cluster presets named after real machines, their collectives, and the per-stage profile of a
parallel layout (tensor parallelism, or Ulysses sequence parallelism with FSDP, inside a node).

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
  runs behind: ``exposed = max((1 - overlap) * comm, comm - compute)`` (:func:`exposed_ms`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from megatron_epp.cost.network import Network
from megatron_epp.cost.profiles import PROFILE_DIR, Accelerator, ModelShape, Profile, TimeCoeffs, analytic_profile

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


INTRA_MODES = ("tp", "sp")  # inside a stage: tensor parallelism, or Ulysses sequence parallelism + FSDP


def measured_profile_path(shape: ModelShape, cluster: Cluster, tp: int) -> Path:
    """Where a measured GPU profile of this shape, device and TP size would be (``scripts/profile_gpu.py --out``)."""
    device = cluster.accelerator.name.split()[0].lower()
    return PROFILE_DIR / f"{shape.name}_{device}_tp{tp}.json"


def tp_profile(shape: ModelShape, cluster: Cluster, tp: int) -> Profile:
    """A stage of ``tp`` tensor-parallel GPUs: the measured profile where one exists, else analytic."""
    path = measured_profile_path(shape, cluster, tp)
    if path.exists():
        return replace(Profile.load(path), model=shape)
    return analytic_profile(shape, tp, cluster.accelerator)


def sp_profile(shape: ModelShape, cluster: Cluster, sp: int, layers_per_stage: int, overlap: float = COMM_OVERLAP) -> Profile:
    """A stage of ``sp`` GPUs running Ulysses sequence parallelism with FSDP (ZeRO-3) inside the node,
    as InfiniPipe does: each GPU computes ``1/sp`` of a chunk's tokens through the whole layer (the
    attention on ``1/sp`` of the heads over all tokens) at the tp = 1 cost, divided by ``sp``; per
    layer the forward pays 4 all-to-alls (Q, K, V, output: ``2 (2 h + 2 h_kv) / sp`` bytes per token and
    GPU, ``(sp-1)/sp`` of it leaving the GPU, over NVLink, not overlapped), the backward the same 4, a
    recompute the forward's again; per layer and chunk, FSDP gathers the layer's bf16 weights in the
    forward (and the recompute) and gathers them again and reduce-scatters the fp32 gradients in the
    backward, with ``(1 - overlap)`` of it exposed (a per-chunk constant: chunks of a pipeline are long
    enough that the compute bound of :func:`exposed_ms` does not bind; stated in docs/baselines.md). Memory: the
    activations per token are Megatron's ``34 h / sp`` (each GPU keeps ``1/sp`` of the tokens), the model
    states are sharded ``sp`` ways, plus two gathered layers of bf16 weights and one of fp32 gradients."""
    if sp < 2 or sp > cluster.gpus_per_node:
        raise ValueError(f"sequence parallel size {sp}: between 2 and the node's {cluster.gpus_per_node} GPUs")
    base = analytic_profile(shape, 1, cluster.accelerator)
    acc = cluster.accelerator
    h, kv = shape.hidden, shape.kv_hidden
    a2a = 2.0 * (2 * h + 2 * kv) / sp * (sp - 1) / sp / (cluster.nvlink_gbps * 1e6)  # ms per token: Q, K, V, output
    a2a_lat = 4 * NVLINK_LATENCY_US * 1e-3
    p_layer = shape.params_per_layer()
    gather = 2.0 * p_layer * (sp - 1) / sp / (cluster.nvlink_gbps * 1e6) * (1 - overlap)
    scatter = 4.0 * p_layer * (sp - 1) / sp / (cluster.nvlink_gbps * 1e6) * (1 - overlap)

    def div(t: TimeCoeffs, comm_token: float, const: float) -> TimeCoeffs:
        return TimeCoeffs(t.a1 / sp, t.a1c / sp, t.a2 / sp + comm_token, t.ac / sp, t.bs, t.b1 + const)

    fwd = div(base.fwd, a2a, a2a_lat + gather)
    bwd = div(base.bwd, a2a, a2a_lat + gather + scatter)
    head = lambda t: TimeCoeffs(t.a1 / sp, t.a1c / sp, t.a2 / sp, t.ac / sp, t.bs, t.b1)  # noqa: E731
    gathered = (2 * 2.0 + 4.0) * sp / max(layers_per_stage, 1)  # per (param / sp) of the stage
    memory = replace(analytic_profile(shape, sp, acc).memory, weight=2.0 + gathered)
    return replace(
        base, device=f"{acc.name} x{sp} (Ulysses SP + FSDP)", tp=sp, fwd=fwd, bwd=bwd, recompute=fwd,
        head_fwd=head(base.head_fwd), head_bwd=head(base.head_bwd), memory=memory,
        fit={"note": f"analytic Ulysses SP={sp} + FSDP in the node, overlap {overlap}; not measured"},
    )


def stage_profile(shape: ModelShape, cluster: Cluster, intra: str, size: int, layers_per_stage: int,
                  overlap: float = COMM_OVERLAP) -> Profile:
    """The per-GPU profile of one pipeline stage of ``size`` GPUs (``intra``: ``tp`` or ``sp``)."""
    if intra == "tp" or size == 1:
        return tp_profile(shape, cluster, size)
    if intra == "sp":
        return sp_profile(shape, cluster, size, layers_per_stage, overlap)
    raise ValueError(f"intra-stage parallelism {intra!r}: one of {', '.join(INTRA_MODES)}")
