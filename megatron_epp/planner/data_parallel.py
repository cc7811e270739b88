"""The data-parallel split of a global batch: one function for training's sampler and for ``epp-plan``."""

from __future__ import annotations

import heapq

import numpy as np

from megatron_epp.cost.features import NUM_FEATURES, F, sequence_features

TOKENS = np.eye(NUM_FEATURES)[F.S]  # a work vector that counts tokens


def dp_split(lengths: np.ndarray, dp: int, work_vector: np.ndarray) -> list[np.ndarray]:
    """Longest-processing-time split over ``dp`` replicas: sequences by modelled work (each as one
    chunk, :func:`sequence_features` ``@ work_vector``, e.g. :meth:`CostModel.work_vector`), most
    first, each onto the replica with the least work so far. Deterministic (ties go to the earlier
    sequence and the lower rank), so every rank computes the same split. Returns, per replica, the
    ascending positions of its sequences."""
    work = sequence_features(lengths) @ np.asarray(work_vector, dtype=float)
    loads = [(0.0, rank) for rank in range(dp)]
    owner = np.empty(len(work), dtype=np.int64)
    for i in np.argsort(-work, kind="stable"):
        load, rank = heapq.heappop(loads)
        owner[i] = rank
        heapq.heappush(loads, (load + work[i], rank))
    return [np.flatnonzero(owner == rank) for rank in range(dp)]
