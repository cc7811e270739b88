"""Sequence grouping (notes section 5.2): consecutive 1F1B pipelines by dynamic programming.

Units (the chunks of one split sequence, or one batched chunk) are sorted by chunk count, most
first. A group ``[i, j)`` of consecutive units runs as one 1F1B pipeline; its cost is its warm-up
and cool-down ``(P - 1) * mean chunk time`` plus an estimate of the recompute it needs to fit:
stage 0 holds ``P + K_max - 1`` chunks in flight (``K_max`` = chunks of the group's first unit), the
excess of the largest such window over the budget is recomputed at the group's average recompute
time per saved byte; a group that does not fit even fully checkpointed costs infinity. The exact
walk and the integer program then decide the real recompute of each chosen group.
"""

from __future__ import annotations

import numpy as np

from megatron_epp.cost.model import ChunkCosts


def _running_window_max(x: np.ndarray, start: int, window: int) -> np.ndarray:
    """``out[e]`` = max over ``q <= e`` of ``sum(x[max(start, q - window) : q])``, for ``e > start``."""
    S = np.concatenate([[0.0], np.cumsum(x)])
    q = np.arange(start + 1, len(x) + 1)
    return np.maximum.accumulate(S[q] - S[np.maximum(start, q - window)])


def group_units(
    unit_sizes: list[int], costs: ChunkCosts, layers: np.ndarray, free_bytes: float, recompute: bool = True
) -> tuple[list[tuple[int, int]], float]:
    """Split units (sizes in chunks, sorted most first; ``costs`` of their chunks in order) into
    consecutive groups; returns ``[(first_unit, end_unit), ...]`` and the estimated overhead (ms).
    ``free_bytes``: stage 0's budget minus its model states; ``recompute=False``: a group must fit
    without checkpointing."""
    P, U = len(layers), len(unit_sizes)
    bounds = np.concatenate([[0], np.cumsum(unit_sizes)]).astype(int)
    step = (costs.fwd + costs.bwd).mean(axis=0)
    T = np.concatenate([[0.0], np.cumsum(step)])
    split = np.repeat(np.asarray(unit_sizes) > 1, unit_sizes)  # the chunks of split sequences
    act = costs.act_layer - costs.lone_layer * split
    kv = costs.kv_layer * split  # each slice's rows of its sequence's K/V buffer
    full = layers[0] * (act + kv)
    least = layers[0] * (costs.ckpt_layer + kv) if recompute else full
    rc_per_byte = costs.rc_layer / np.maximum(act - costs.ckpt_layer, 1e-9)
    R = np.concatenate([[0.0], np.cumsum(rc_per_byte)])
    best = np.full(U + 1, np.inf)
    best[0] = 0.0
    back = np.zeros(U + 1, dtype=int)
    for i in range(U):
        if not np.isfinite(best[i]):
            continue
        s = bounds[i]
        window = P + unit_sizes[i] - 1
        ends = bounds[i + 1 :]  # chunk end of groups [i, j) for j = i+1 .. U
        n = ends - s
        workspace = np.maximum.accumulate(costs.act_layer[s:])[n - 1]
        peak = _running_window_max(full, s, window)[n - 1] + workspace
        floor = _running_window_max(least, s, window)[n - 1] + workspace
        rc_ms = np.maximum(peak - free_bytes, 0.0) * (R[ends] - R[s]) / n
        cost = (P - 1) * (T[ends] - T[s]) / n + np.where(floor > free_bytes, np.inf, rc_ms)
        cand = best[i] + cost
        better = cand < best[i + 1 :]
        best[i + 1 :][better] = cand[better]
        back[i + 1 :][better] = i
    groups, j = [], U
    while j > 0:
        groups.append((int(back[j]), j))
        j = back[j]
    return groups[::-1], float(best[U])
