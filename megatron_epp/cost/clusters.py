"""Cluster presets named after real machines, their collectives, and the profile a stage of ``tp`` GPUs starts from
(:func:`tp_profile`; placed on a layout by :func:`~megatron_epp.cost.placement.place_profile`).

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
  parallelism's all-to-alls hide nothing (core attention waits for them:
  :func:`~megatron_epp.cost.placement.place_profile`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from megatron_epp.cost.host import HostLink
from megatron_epp.cost.network import Network
from megatron_epp.cost.analytic import Accelerator, analytic_profile
from megatron_epp.cost.profile import Profile
from megatron_epp.cost.profile_lookup import PROFILE_DIR
from megatron_epp.cost.shape import ModelShape

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

# Host memory and device <-> host copies (activation offload): ASSUMPTIONS, chosen, not measured; the executor's
# start-up measurement replaces them when it exists. Per GPU and direction, all 8 GPUs of the node copying at once.
# H100 SXM5 (DGX H100 class): PCIe Gen5 x16 per GPU, 64 GB/s per direction on paper; pinned copies with every GPU
# copying reach well below it (two GPUs share a PCIe switch's uplink to a CPU socket): 25 GB/s chosen, the low end of
# the 25-50 GB/s reported for such nodes. Host memory: 2 TB (the DGX H100's 2 TB of DDR5).
H100_HOST = HostLink(d2h_gbps=25.0, h2d_gbps=25.0, host_memory_gb=2048.0, gpus_per_node=8,
                     description="assumed: PCIe Gen5 x16, 25 GB/s per GPU and direction with 8 copying; 2 TB host memory")
# A800 SXM4 (HGX A800 class): PCIe Gen4 x16 per GPU, 32 GB/s per direction on paper: 20 GB/s chosen; host memory:
# 1 TB chosen (such nodes ship with 1-2 TB: the smaller).
A800_HOST = HostLink(d2h_gbps=20.0, h2d_gbps=20.0, host_memory_gb=1024.0, gpus_per_node=8,
                     description="assumed: PCIe Gen4 x16, 20 GB/s per GPU and direction with 8 copying; 1 TB host memory")


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
    host: HostLink | None = None  # host memory and copy bandwidth (activation offload); None: not modelled

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes

    def with_nodes(self, num_nodes: int, gpus_per_node: int | None = None) -> "Cluster":
        per_node = gpus_per_node or self.gpus_per_node
        host = None if self.host is None else replace(self.host, gpus_per_node=per_node)
        return replace(self, num_nodes=num_nodes, gpus_per_node=per_node, host=host)

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
    return Cluster(name, acc, 80.0, 8, 4, nvlink, ib, what, H100_HOST if acc is H100_SXM else A800_HOST)


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
    """The profile a stage of ``tp`` tensor-parallel GPUs starts from (at ``cp`` 1): the measured profile where one
    exists, else analytic at ``tp``."""
    path = measured_profile_path(shape, cluster, tp)
    if path.exists():
        return replace(Profile.load(path), model=shape)
    return analytic_profile(shape, tp, cluster.accelerator)
