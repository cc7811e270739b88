"""What activation offload moves between a stage's GPU and the host, and what of it compute does not hide
(docs/planner.md, "Activation offload").

Per (stage, chunk) and phase, bytes out (device to host) and in (host to device):

* a checkpoint offloaded (``offload[stage][k]`` of the chunk's checkpointed layers): its layer input goes out during
  the chunk's forward and comes back during its backward;
* a split sequence's K/V buffer on the host (``kv_host``), per layer of the stage: a slice's forward fetches its
  prefix's K/V and writes its own out; its backward fetches its prefix's and its own K/V and, where the gradient
  accumulators are counted (``kv_grad``), fetches theirs and writes them back.

The two directions copy at once (one copy engine each); a phase's copies hide behind that phase's compute of the same
chunk on the same stage (its forward; its backward with its recompute) and what is left is exposed: ``max(0, max(out
/ d2h, in / h2d) - compute)`` (:func:`~megatron_epp.cost.host.exposed_copy_ms`). Conservative: a copy never hides
behind another chunk's compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_epp.cost.host import HostLink, exposed_copy_ms
from megatron_epp.cost.model import ChunkCosts
from megatron_epp.plan import Pipeline
from megatron_epp.simulator.memory import kv_host_units


@dataclass
class CopyBytes:
    """Bytes per (stage, chunk) that do not depend on the checkpoint offload decision (the K/V buffers on the host),
    by phase and direction; a checkpoint offloaded adds ``ckpt`` to ``fwd_out`` and ``bwd_in``."""

    fwd_out: np.ndarray  # (P, n)
    fwd_in: np.ndarray
    bwd_out: np.ndarray
    bwd_in: np.ndarray


def kv_copy_bytes(pipe: Pipeline, costs: ChunkCosts, layers: np.ndarray) -> CopyBytes:
    """The K/V buffers' copies of ``pipe``'s sequences on the host (module docstring); zeros without any."""
    return units_copy_bytes(kv_host_units(pipe), costs, layers)


def units_copy_bytes(units: list, costs: ChunkCosts, layers: np.ndarray) -> CopyBytes:
    """The K/V buffers' copies of the split sequences ``units`` (each its chunks' positions, in order) on the host."""
    n = costs.fwd.shape[1]
    own, prefix = np.zeros(n), np.zeros(n)
    for u in units:
        kv = costs.kv_layer[u]
        own[u] = kv
        prefix[u] = np.cumsum(kv) - kv
    L = np.asarray(layers, dtype=float)[:, None]
    g = costs.kv_grad
    return CopyBytes(L * own, L * prefix, L * (prefix + own) * g, L * (prefix + own) * (1.0 + g))


def kv_host_copy_ms(units: list, costs: ChunkCosts, layers: np.ndarray, host: HostLink) -> np.ndarray:
    """Per stage, the copy time no compute hides with the K/V buffers of ``units`` on the host and nothing else
    offloaded: each (stage, chunk) phase's copies behind that phase's compute (the backward's without recompute, which
    would hide more), summed over the chunks."""
    kv = units_copy_bytes(units, costs, layers)
    fwd = exposed_copy_ms(host, kv.fwd_out, kv.fwd_in, costs.fwd)
    bwd = exposed_copy_ms(host, kv.bwd_out, kv.bwd_in, costs.bwd)
    return (fwd + bwd).sum(axis=1)


def exposed_ms(pipe: Pipeline, costs: ChunkCosts, layers: np.ndarray, host: HostLink | None) -> tuple[np.ndarray, np.ndarray]:
    """``(fwd, bwd)``: per (stage, chunk) the copy time not hidden behind the chunk's forward, and behind its backward
    with its recompute; zeros where nothing is offloaded."""
    shape = costs.fwd.shape
    if host is None or not (pipe.kv_host or any(map(any, pipe.offload))):
        return np.zeros(shape), np.zeros(shape)
    kv = kv_copy_bytes(pipe, costs, layers)
    ckpt = np.array([pipe.offloaded(p) for p in range(shape[0])], dtype=float) * costs.ckpt_layer[None, :]
    rc = np.array(pipe.recompute, dtype=float) * costs.rc_layer[None, :]
    fwd = exposed_copy_ms(host, kv.fwd_out + ckpt, kv.fwd_in, costs.fwd)
    bwd = exposed_copy_ms(host, kv.bwd_out, kv.bwd_in + ckpt, costs.bwd + rc)
    return fwd, bwd
