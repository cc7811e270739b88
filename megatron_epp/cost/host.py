"""The host side of activation offload (docs/planner.md, "Activation offload"): a node's host memory and the
device-to-host / host-to-device copy bandwidth of one GPU, and what a copy leaves exposed.

A :class:`HostLink` is part of a cluster preset (:mod:`.clusters`: the figures there are assumptions, stated as
chosen, until the executor measures them at start-up) and of a :class:`~megatron_epp.cost.model.CostModel` that may
plan offload. Bandwidths are per GPU and direction, with every GPU of the node copying at once (pinned host memory,
one copy engine per direction: a device-to-host and a host-to-device copy run together).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from megatron_epp.base.units import GIB

# --epp-host-memory-budget's default: this share of the node's host memory, divided among its local ranks (the rest:
# the operating system, the data loader's workers, the pinned staging of the framework itself)
HOST_MEMORY_SHARE = 0.75


@dataclass(frozen=True)
class HostLink:
    """``host_memory_gb`` of host memory per node (GB as the budgets', binary), shared by ``gpus_per_node`` local ranks;
    ``d2h_gbps`` / ``h2d_gbps``: one GPU's copy bandwidth to / from pinned host memory, GB/s (10^9 B/s), all GPUs of
    the node copying at once."""

    d2h_gbps: float
    h2d_gbps: float
    host_memory_gb: float
    gpus_per_node: int
    description: str = ""

    @property
    def host_bytes(self) -> float:
        """The node's host memory in bytes."""
        return self.host_memory_gb * GIB

    def default_budget_bytes(self) -> float:
        """Per GPU (local rank): :data:`HOST_MEMORY_SHARE` of the node's host memory over its local ranks."""
        return HOST_MEMORY_SHARE * self.host_bytes / self.gpus_per_node

    def check_budget(self, budget_bytes: float) -> None:
        """One-line ``ValueError`` for a host budget per GPU the node cannot hold (over all its local ranks), or a
        negative one."""
        if budget_bytes < 0:
            raise ValueError(f"--epp-host-memory-budget {budget_bytes / GIB:g}: must be >= 0")
        if budget_bytes * self.gpus_per_node > self.host_bytes * (1 + 1e-12):
            raise ValueError(
                f"--epp-host-memory-budget {budget_bytes / GIB:g} GB per GPU x {self.gpus_per_node} GPUs per node = "
                f"{budget_bytes * self.gpus_per_node / GIB:g} GB: more than the node's {self.host_memory_gb:g} GB of host memory")

    @property
    def d2h_bytes_per_ms(self) -> float:
        return self.d2h_gbps * 1e6

    @property
    def h2d_bytes_per_ms(self) -> float:
        return self.h2d_gbps * 1e6


# the copy bandwidth assumed on a training run's own node (GB/s per GPU and direction; the H100 preset's figure, stated
# as chosen) until the start-up measurement replaces it (measure/host_bandwidth.py, :func:`measured_host_link`): the
# planner built before start-up (the memory budget's check) plans on it
LOCAL_COPY_GBPS = 25.0


def host_memory_bytes() -> float:
    """This node's physical memory in bytes (``sysconf``; 0 where it cannot say)."""
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def local_host_link(local_ranks: int | None = None) -> HostLink:
    """The host link of the node a training run is on: its memory (:func:`host_memory_bytes`), shared by its local
    ranks (``LOCAL_WORLD_SIZE``, else 1), and :data:`LOCAL_COPY_GBPS` each way."""
    ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return HostLink(LOCAL_COPY_GBPS, LOCAL_COPY_GBPS, host_memory_bytes() / GIB, ranks, "this node (copy bandwidth assumed)")


def measured_host_link(d2h_bytes_per_ms: float, h2d_bytes_per_ms: float, local_ranks: int | None = None) -> HostLink:
    """This node's host link (:func:`local_host_link`) with the copy bandwidth measured at start-up, in bytes per ms
    each way (``measure.host_bandwidth``: all local ranks copying at once, the minimum over the ranks)."""
    link = local_host_link(local_ranks)
    return HostLink(d2h_bytes_per_ms / 1e6, h2d_bytes_per_ms / 1e6, link.host_memory_gb, link.gpus_per_node,
                    "this node (copy bandwidth measured at start-up)")


def exposed_copy_ms(link: HostLink, d2h_bytes, h2d_bytes, compute_ms):
    """What copies of ``d2h_bytes`` out and ``h2d_bytes`` in (both directions at once) leave exposed behind
    ``compute_ms`` of overlappable work: ``max(0, max(d2h time, h2d time) - compute)`` (arrays elementwise)."""
    return np.maximum(np.maximum(np.asarray(d2h_bytes) / link.d2h_bytes_per_ms, np.asarray(h2d_bytes) / link.h2d_bytes_per_ms)
                      - np.asarray(compute_ms), 0.0)
