"""Network presets: stage-to-stage point-to-point, and the collectives of sequence parallelism.

A pipeline stage is one tensor-parallel group of ``gpus_per_node`` GPUs (one node); consecutive
stages sit on different nodes and each GPU sends its sequence-parallel shard to its peer on the same
rail. Sequence parallelism (FlexSP baseline) runs all-to-alls inside NVLink up to one node, and
across nodes at the topology's all-to-all bandwidth. The numbers are presets for comparison (per GPU
400 Gb/s NICs), not measurements; pass a different preset to redo the comparison per network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Network:
    """Per-GPU bandwidths (GB/s) and latencies (us)."""

    name: str
    p2p_gbps: float  # stage-to-stage, per GPU
    p2p_latency_us: float
    a2a_gbps: float  # all-to-all across nodes, effective per GPU
    a2a_latency_us: float
    nvlink_gbps: float = 450.0
    nvlink_latency_us: float = 3.0
    gpus_per_node: int = 8
    description: str = ""

    def p2p_ms(self, nbytes: float) -> float:
        """One stage-to-stage send of ``nbytes`` per GPU (works on arrays)."""
        return self.p2p_latency_us * 1e-3 + nbytes / (self.p2p_gbps * 1e6)

    def alltoall_ms(self, nbytes: float, group: int) -> float:
        """All-to-all of ``nbytes`` per GPU in a group of ``group`` GPUs ((g-1)/g of it leaves the GPU):
        the share for GPUs of the same node at NVLink speed, the rest at ``a2a_gbps``, both at once."""
        if group <= 1:
            return 0.0
        local = min(group, self.gpus_per_node)
        intra = nbytes * (local - 1) / group / (self.nvlink_gbps * 1e6)
        inter = nbytes * (group - local) / group / (self.a2a_gbps * 1e6)
        lat = self.nvlink_latency_us if group <= self.gpus_per_node else self.a2a_latency_us
        return lat * 1e-3 * math.log2(group) + max(intra, inter)


NETWORKS: dict[str, Network] = {
    "fat-tree": Network("fat-tree", 50.0, 5.0, 40.0, 10.0, description="non-blocking 3-tier fat-tree, 400G per GPU"),
    "rail-optimized": Network(
        "rail-optimized", 50.0, 3.0, 30.0, 8.0,
        description="rail switches: same-rail p2p in one hop; cross-rail all-to-all through NVLink relay and spine",
    ),
    "railx-2d": Network(
        "railx-2d", 50.0, 2.0, 15.0, 12.0,
        description="RailX-like 2D direct-connect rails: neighbour p2p direct; all-to-all multi-hop over the 2D grid",
    ),
    "cpu-local": Network("cpu-local", 2.0, 50.0, 2.0, 50.0, 2.0, 50.0, 1, description="processes on one host (gloo over loopback)"),
}


def get_network(name: str) -> Network:
    if name not in NETWORKS:
        raise ValueError(f"unknown network {name!r}; presets: {', '.join(NETWORKS)}")
    return NETWORKS[name]
