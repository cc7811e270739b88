"""Sequence grouping (docs/planner.md, "`epp-plan` and the EPP search"): consecutive 1F1B pipelines by dynamic programming.

Units (the chunks of one split sequence, or one batched chunk) are sorted by chunk count, most
first. A group ``[i, j)`` of consecutive units runs as one 1F1B pipeline; its cost is its warm-up
and cool-down ``(P - 1) * mean chunk time`` plus an estimate of the recompute it needs to fit:
stage 0 holds ``P + K_max - 1`` chunks in flight (``K_max`` = chunks of the group's first unit), and
the whole K/V buffer of every split sequence with a slice in the window (a sequence's slices run
backward last to first, so its first slice, which holds the buffer, stays in flight longest); the
excess of the largest such window over the budget is recomputed in each of the group's ``n / window``
windows at the group's average recompute time per saved byte; a group that does not fit even fully checkpointed costs infinity. The exact
walk and the integer program then decide the real recompute of each chosen group.
"""

from __future__ import annotations

import numpy as np

from megatron_epp.cost.model import ChunkCosts
from megatron_epp.simulator.memory import KV_WINDOW


def _running_window_max(S: np.ndarray, extra: np.ndarray, start: int, window: int, ends: np.ndarray) -> np.ndarray:
    """``out[e]`` = max over ``start < q <= e`` of ``sum(x[a : q]) + extra[a]``, ``a = max(start, q - window)``,
    for every ``e`` of ``ends``, where ``S`` is the prefix sum of ``x`` (``S[0] = 0``)."""
    q = np.arange(start + 1, ends[-1] + 1)
    a = np.maximum(start, q - window)
    return np.maximum.accumulate(S[q] - S[a] + extra[a])[ends - start - 1]


def group_units(
    unit_sizes: list[int], costs: ChunkCosts, layers: np.ndarray, free_bytes: float, recompute: bool = True
) -> tuple[list[tuple[int, int]], float]:
    """Split units (sizes in chunks, sorted most first; ``costs`` of their chunks in order) into
    consecutive groups; returns ``[(first_unit, end_unit), ...]`` and the estimated overhead (ms).
    ``free_bytes``: stage 0's budget minus its model states; ``recompute=False``: a group must fit
    without checkpointing."""
    return group_units_both(unit_sizes, costs, layers, free_bytes)[recompute]


def group_units_both(
    unit_sizes: list[int], costs: ChunkCosts, layers: np.ndarray, free_bytes: float, prune: bool = True,
    offload: str = "none",
) -> dict[bool, tuple[list[tuple[int, int]], float]]:
    """:func:`group_units` with recompute allowed (``True``) and without (``False``) in one pass:
    ``([], inf)`` where no grouping fits. ``prune``: skip the units reached dearer than the best whole answer so
    far (exact while no group costs less than nothing; False: every unit starts groups, the same answer slower).
    ``offload`` (``--epp-offload``): what the floor of a group fully checkpointed may leave to the host: with
    ``checkpoints`` its checkpoints, with ``auto`` also its split sequences' K/V buffers (for their device window)."""
    P, U = len(layers), len(unit_sizes)
    bounds = np.concatenate([[0], np.cumsum(unit_sizes)]).astype(int)
    step = (costs.fwd + costs.bwd).mean(axis=0)
    T = np.concatenate([[0.0], np.cumsum(step)])
    split = np.repeat(np.asarray(unit_sizes) > 1, unit_sizes)  # the chunks of split sequences
    act = costs.act_layer - costs.lone_layer * split
    # a split sequence's K/V buffer is held from its first slice's forward to that slice's backward,
    # its last: all of it counts at the first slice, and in a window that starts inside the unit; its
    # gradient accumulators (its backward only, where counted) with it: an estimate on the safe side
    unit_buffer = layers[0] * (1.0 + costs.kv_grad) * np.add.reduceat(costs.kv_layer * split, bounds[:-1])
    buffer = np.zeros(len(act))
    buffer[bounds[:-1]] = unit_buffer
    unit_of = np.repeat(np.arange(U), unit_sizes)
    inside = np.append(np.where(bounds[unit_of] < np.arange(len(act)), unit_buffer[unit_of], 0.0), 0.0)
    full = layers[0] * act + buffer
    least = layers[0] * costs.ckpt_layer + buffer
    inside_least = inside
    if offload != "none":  # the checkpoints on the host (and the K/V buffers, but for their window)
        least, inside_least = _offloaded_floor(costs, unit_sizes, bounds, split, buffer, inside, offload == "auto")
    rc_per_byte = costs.rc_layer / np.maximum(act - costs.ckpt_layer, 1e-9)
    R = np.concatenate([[0.0], np.cumsum(rc_per_byte)])
    S_full, S_least = (np.concatenate([[0.0], np.cumsum(x)]) for x in (full, least))
    monotone = prune and bool((step >= 0).all() and (rc_per_byte >= 0).all())  # no group costs less than nothing
    best = {flag: np.full(U + 1, np.inf) for flag in (True, False)}
    back = {flag: np.zeros(U + 1, dtype=int) for flag in (True, False)}
    best[True][0] = best[False][0] = 0.0
    for i in range(U):
        # a unit reached dearer than the best answer so far starts no group of the answer (no cost is negative)
        if not any(np.isfinite(best[f][i]) and (best[f][i] <= best[f][U] or not monotone) for f in (True, False)):
            continue
        s = bounds[i]
        window = P + unit_sizes[i] - 1
        ends = bounds[i + 1 :]  # chunk end of groups [i, j) for j = i+1 .. U
        workspace = np.maximum.accumulate(costs.act_layer[s:])[ends - s - 1]
        # the floor grows with the group: from the first group that cannot fit on, none can
        fits = np.searchsorted(_running_window_max(S_least, inside_least, s, window, ends) + workspace > free_bytes, True)
        if not fits:
            continue
        ends, workspace = ends[:fits], workspace[:fits]
        n = ends - s
        peak = _running_window_max(S_full, inside, s, window, ends) + workspace
        bubbles = (P - 1) * (T[ends] - T[s]) / n
        # the excess is saved in every window of the group: about n / window times
        rc_ms = np.maximum(peak - free_bytes, 0.0) * (R[ends] - R[s]) / n * np.maximum(1.0, n / window)
        for flag, cost in ((True, bubbles + rc_ms), (False, bubbles[: np.searchsorted(peak > free_bytes, True)])):
            cand = best[flag][i] + cost
            seg = best[flag][i + 1 : i + 1 + len(cand)]
            better = cand < seg
            seg[better] = cand[better]
            back[flag][i + 1 : i + 1 + len(cand)][better] = i
    out = {}
    for flag in (True, False):
        groups, j = [], U
        while j > 0 and np.isfinite(best[flag][U]):
            groups.append((int(back[flag][j]), j))
            j = back[flag][j]
        out[flag] = (groups[::-1], float(best[flag][U]))
    return out


def _offloaded_floor(costs: ChunkCosts, unit_sizes: list[int], bounds: np.ndarray, split: np.ndarray, buffer: np.ndarray,
                     inside: np.ndarray, kv_on_host: bool) -> tuple[np.ndarray, np.ndarray]:
    """The floor of :func:`group_units_both` under offload: per chunk its K/V buffer, or with ``kv_on_host`` its
    device window (:data:`~megatron_epp.simulator.memory.KV_WINDOW` blocks of the unit's largest slice and its
    accumulators); and the window's share of a unit begun before the group (``inside``'s)."""
    if not kv_on_host:
        return buffer.copy(), inside
    U = len(unit_sizes)
    unit_window = KV_WINDOW * (1.0 + costs.kv_grad) * np.maximum.reduceat(costs.kv_layer * split, bounds[:-1])
    least = np.zeros(len(buffer))
    least[bounds[:-1]] = unit_window
    unit_of = np.repeat(np.arange(U), unit_sizes)
    inside_least = np.append(np.where(bounds[unit_of] < np.arange(len(buffer)), unit_window[unit_of], 0.0), 0.0)
    return least, inside_least
