"""Workload-balanced chunking (notes section 5.1): slicing long sequences, packing the rest.

Work of a chunk = its forward + backward time on the whole model (:meth:`CostModel.work_vector`).
A sequence is *long* if its work exceeds the slice budget ``T_t`` or its length the token cap
``T_m``. A long sequence is cut front to back into slices of work exactly ``T_t`` (at most ``T_m``
tokens): later slices attend to a longer prefix, so they are shorter. The remainder is the tail.
Tails seed buckets; whole short sequences, longest first, go to the feasible bucket that they fill
best (least time left, best-fit decreasing); if none fits under ``T_t`` the budget is relaxed by
``relax``; only then a new bucket opens. The result is a list of *units*: the chunks of one split
sequence (its last chunk is the tail's bucket), or one batched chunk.
"""

from __future__ import annotations

import bisect
from typing import Literal

import numpy as np

from megatron_epp.plan import Chunk, Segment, chunk_kind
from megatron_epp.cost.features import F, segment_features, sequence_features

Units = list[list[Chunk]]
PACK_RELAX = 0.1  # how far past the slice budget a bucket may be filled when no bucket fits


def _cut_steps(lengths: np.ndarray, budget: np.ndarray | float, token_cap: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cut points of :func:`slice_cuts`, flat: ``(sequence, point)`` pairs of every sequence's
    points after its 0, in cut order (a sequence is left out once cut to its end)."""
    L = np.asarray(lengths, dtype=np.int64)
    tau = np.broadcast_to(np.asarray(budget, dtype=float), L.shape)
    active = np.flatnonzero(L > 0)
    C = np.zeros(len(active), dtype=np.int64)
    rows, points = [], []
    while len(active):
        a, b, c = w[F.SQ], w[F.SC] * C + w[F.S], w[F.C] * C + w[F.SEGMENTS] + w[F.CHUNKS] - tau[active]
        disc = np.sqrt(np.maximum(b * b - 4 * a * c, 0.0))
        s = (-b + disc) / (2 * a) if a > 0 else -c / np.maximum(b, 1e-300)
        s = np.clip(np.rint(s), 1, token_cap).astype(np.int64)
        C = np.minimum(C + s, L[active])
        rows.append(active)
        points.append(C)
        going = C < L[active]
        active, C = active[going], C[going]
    if not rows:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    rows_flat, points_flat = np.concatenate(rows), np.concatenate(points)
    order = np.argsort(rows_flat, kind="stable")
    return rows_flat[order], points_flat[order]


def slice_cuts(lengths: np.ndarray, budget: np.ndarray | float, token_cap: int, w: np.ndarray) -> list[np.ndarray]:
    """Cut points ``[0, c1, ..., L]`` of every sequence: slices of work ``budget`` (per sequence or
    one for all) and at most ``token_cap`` tokens, the last slice the remainder. ``w``: work vector."""
    n = len(lengths)
    rows, points = _cut_steps(lengths, budget, token_cap, w)
    counts = np.bincount(rows, minlength=n)
    flat = np.insert(points, np.concatenate([[0], np.cumsum(counts)[:-1]]) if n else [], 0)  # each sequence's 0 first
    return np.split(flat, np.cumsum(counts + 1)[:-1]) if n else []


def equal_count_cuts(lengths: np.ndarray, k: int, w: np.ndarray, token_cap: int) -> list[np.ndarray]:
    """Cut every sequence into ``k`` slices of equal work (bisection on the per-sequence budget)."""
    L = np.asarray(lengths, dtype=np.int64)
    one_chunk = sequence_features(L) @ w
    lo, hi = one_chunk / (4 * k), one_chunk  # work of one slice lies in between
    for _ in range(40):
        mid = (lo + hi) / 2
        too_many = np.bincount(_cut_steps(L, mid, token_cap, w)[0], minlength=len(L)) > k  # slices per sequence
        lo, hi = np.where(too_many, mid, lo), np.where(too_many, hi, mid)
    return slice_cuts(L, hi, token_cap, w)


def even_cuts(lengths: np.ndarray, token_cap: int) -> list[np.ndarray]:
    """Equal-length slices of at most ``token_cap`` tokens (no workload balance)."""
    return [np.round(np.linspace(0, n, -(-n // token_cap) + 1)).astype(np.int64) for n in np.asarray(lengths)]


def pack(
    sizes: np.ndarray,
    item_time: np.ndarray,
    seed_time: np.ndarray,
    seed_tokens: np.ndarray,
    chunk_time: float,
    time_budget: float,
    token_cap: int,
    relax: float = PACK_RELAX,
    key: Literal["time", "tokens"] = "time",
) -> list[int]:
    """Best-fit decreasing: bucket index of every item (items in the given order, longest first).

    Buckets ``0 .. len(seed_time) - 1`` are the seeds; a new bucket costs ``chunk_time``. ``key``:
    fit by time left (workload balance) or by tokens left (fixed-length packing). Buckets are kept
    sorted by what is left, so the best fit is a bisection; buckets without room for the smallest item
    are dropped from the search.
    """
    by_time = key == "time"
    btime, btok = [float(t) for t in seed_time], [int(t) for t in seed_tokens]

    def left(b: int) -> float:
        return time_budget - btime[b] if by_time else token_cap - btok[b]

    smallest = int(sizes.min()) if len(sizes) else 0
    order = sorted((left(b), b) for b in range(len(btime)) if btok[b] + smallest <= token_cap)
    out = []
    for it, sz in zip(item_time.tolist(), sizes.tolist()):
        j = bisect.bisect_left(order, (it if by_time else sz, -1))
        choice = None
        for k in range(j, len(order)):  # the best fit by the key within the other limit
            b = order[k][1]
            if btok[b] + sz <= token_cap and btime[b] + it <= time_budget:
                choice = k
                break
        if choice is None and by_time:  # relax the time budget: least overflow first
            for k in range(j - 1, -1, -1):
                b = order[k][1]
                if btime[b] + it > time_budget * (1 + relax):
                    break
                if btok[b] + sz <= token_cap:
                    choice = k
                    break
        if choice is None:
            b = len(btime)
            btime.append(chunk_time)
            btok.append(0)
        else:
            b = order.pop(choice)[1]
        btime[b] += it
        btok[b] += sz
        if btok[b] + smallest <= token_cap:  # a bucket without room for the smallest item is left out
            bisect.insort(order, (left(b), b))
        out.append(b)
    return out


def build_units(
    lengths: np.ndarray,
    w: np.ndarray,
    time_budget: float,
    token_cap: int,
    balance: bool = True,
    cuts: list[np.ndarray] | None = None,
) -> Units:
    """Chunk a batch: slice the long sequences and pack the rest. ``cuts`` overrides the slicing
    (sequences with a single slice are then packed); ``balance=False``: even slices, packing by tokens."""
    L = np.asarray(lengths, dtype=np.int64)
    seg_feats = sequence_features(L)
    seg_feats[:, F.CHUNKS] = 0.0  # one whole segment, without its chunk's launch constant
    seg = seg_feats @ w
    if cuts is None:
        long = (L > token_cap) | (balance & (seg + w[F.CHUNKS] > time_budget))
        idx = np.flatnonzero(long)
        sliced = slice_cuts(L[idx], time_budget, token_cap, w) if balance else even_cuts(L[idx], token_cap)
    else:
        idx = np.flatnonzero([len(c) > 2 for c in cuts])
        sliced = [cuts[i] for i in idx]
    long_units: Units = []
    tails = []
    for i, c in zip(idx.tolist(), sliced):
        c = c.tolist()
        long_units.append([Chunk(-1, "split", [Segment(i, a, b)]) for a, b in zip(c[:-2], c[1:-1])])
        tails.append(Segment(i, c[-2], c[-1]))
    short = np.setdiff1d(np.arange(len(L)), idx)
    short = short[np.argsort(-L[short], kind="stable")]
    tl = np.array([t.length for t in tails], dtype=float)
    tc = np.array([t.start for t in tails], dtype=float)
    seed_time = segment_features(tl, tc) @ w if tails else np.zeros(0)
    where = pack(L[short], seg[short], seed_time, tl, float(w[F.CHUNKS]), time_budget, token_cap, key="time" if balance else "tokens")
    buckets: list[list[Segment]] = [[t] for t in tails] + [[] for _ in range(max(where, default=-1) + 1 - len(tails))]
    seq_lengths = L.tolist()
    for i, b in zip(short.tolist(), where):
        buckets[b].append(Segment(i, 0, seq_lengths[i]))
    chunks = [Chunk(-1, chunk_kind(b, seq_lengths), b) for b in buckets]
    for unit, tail_chunk in zip(long_units, chunks):
        unit.append(tail_chunk)
    return long_units + [[c] for c in chunks[len(tails) :]]
