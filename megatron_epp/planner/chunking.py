"""Workload-balanced chunking (docs/planner.md, "`epp-plan` and the EPP search"): slicing long sequences, packing the rest.

Work of a chunk = its forward + backward time on the whole model (:meth:`CostModel.work_vector`).
A sequence is *long* if its work exceeds the slice budget ``T_t`` or its length the token cap
``T_m``. A long sequence is cut front to back into slices of work exactly ``T_t`` (at most ``T_m``
tokens): later slices attend to a longer prefix, so they are shorter. The remainder is the tail.
Tails seed buckets; whole short sequences, longest first, go to the feasible bucket that they fill
best (least time left, best-fit decreasing); if none fits under ``T_t`` the budget is relaxed by
``relax``; only then a new bucket opens. The result is a list of *units*: the chunks of one split
sequence (its last chunk is the tail's bucket), or one batched chunk; held as arrays
(:class:`Chunking`), since the planner scores many chunkings and plans few.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Literal

import numpy as np

from megatron_epp.plan import Chunk, Segment
from megatron_epp.cost.features import NUM_FEATURES, F, segment_features, sequence_features

PACK_RELAX = 0.1  # how far past the slice budget a bucket may be filled when no bucket fits


def _slice_end(C: np.ndarray, tau: np.ndarray, token_cap: int, w: np.ndarray) -> np.ndarray:
    """Where the slice of work ``tau`` that starts after a prefix of ``C`` tokens ends (1 to ``token_cap`` tokens)."""
    a, b, c = w[F.SQ], w[F.SC] * C + w[F.S], w[F.C] * C + w[F.SEGMENTS] + w[F.CHUNKS] - tau
    disc = np.sqrt(np.maximum(b * b - 4 * a * c, 0.0))
    s = (-b + disc) / (2 * a) if a > 0 else -c / np.maximum(b, 1e-300)
    return C + np.minimum(np.maximum(np.rint(s), 1), token_cap).astype(np.int64)  # clip's answer, fewer calls


def _cut_steps(lengths: np.ndarray, budget: np.ndarray | float, token_cap: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cut points of :func:`slice_cuts`, flat: ``(sequence, point)`` pairs of every sequence's
    points after its 0, in cut order (a sequence is left out once cut to its end)."""
    L = np.asarray(lengths, dtype=np.int64)
    tau = np.broadcast_to(np.asarray(budget, dtype=float), L.shape)
    active = np.flatnonzero(L > 0)
    C = np.zeros(len(active), dtype=np.int64)
    rows, points = [], []
    while len(active):
        C = np.minimum(_slice_end(C, tau[active], token_cap, w), L[active])
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


BISECTION_STEPS = 40  # equal_count_cuts' bisection on the slice budget
BISECTION_LEVELS = 4  # its steps taken at once: every path's budgets of the next levels counted in one pass


def equal_count_cuts(lengths: np.ndarray, k: int, w: np.ndarray, token_cap: int) -> list[np.ndarray]:
    """Cut every sequence into ``k`` slices of equal work: a bisection on the per-sequence budget
    (:data:`BISECTION_STEPS` steps), :data:`BISECTION_LEVELS` of them per pass: the budgets every path of the next
    levels would try (a complete binary tree of midpoints, each the midpoint the sequential bisection computes
    there) are counted at once and the path is then read off, so the answer is the sequential bisection's."""
    L = np.asarray(lengths, dtype=np.int64)
    one_chunk = sequence_features(L) @ w
    lo, hi = one_chunk / (4 * k), one_chunk  # work of one slice lies in between
    rows = np.arange(len(L))
    for done in range(0, BISECTION_STEPS, BISECTION_LEVELS):
        levels = min(BISECTION_LEVELS, BISECTION_STEPS - done)
        a, b = lo[:, None], hi[:, None]
        mids = []  # per level, the midpoints of its 2^level intervals (node j's children: left 2j, right 2j + 1)
        for _ in range(levels):
            m = (a + b) / 2
            mids.append(m)
            width = 2 * m.shape[1]
            a, b = np.stack([a, m], axis=2).reshape(len(L), width), np.stack([m, b], axis=2).reshape(len(L), width)
        tau = np.concatenate(mids, axis=1)
        C = np.zeros(tau.shape, dtype=np.int64)
        for _ in range(k):  # k slices of work tau (a sequence cut to its end stays there)
            C = np.minimum(_slice_end(C, tau, token_cap, w), L[:, None])
        too_many = C < L[:, None]  # more than k slices
        node = np.zeros(len(L), dtype=np.int64)
        for level in range(levels):  # down the path: more than k slices -> the upper half
            j = (1 << level) - 1 + node
            t, mid = too_many[rows, j], tau[rows, j]
            lo, hi = np.where(t, mid, lo), np.where(t, hi, mid)
            node = 2 * node + t
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
    smallest = int(sizes.min()) if len(sizes) else 0
    # the open buckets sorted by (what is left, bucket): two parallel lists, bisected on the first
    order = sorted((time_budget - btime[b] if by_time else token_cap - btok[b], b) for b in range(len(btime)) if btok[b] + smallest <= token_cap)
    lefts, ids = [o[0] for o in order], [o[1] for o in order]
    relaxed = time_budget * (1 + relax)
    out = []
    for it, sz in zip(item_time.tolist(), sizes.tolist()):
        j = bisect.bisect_left(lefts, it if by_time else sz)
        choice = None
        for k in range(j, len(ids)):  # the best fit by the key within the other limit
            b = ids[k]
            if btok[b] + sz <= token_cap and btime[b] + it <= time_budget:
                choice = k
                break
        if choice is None and by_time:  # relax the time budget: least overflow first
            for k in range(j - 1, -1, -1):
                b = ids[k]
                if btime[b] + it > relaxed:
                    break
                if btok[b] + sz <= token_cap:
                    choice = k
                    break
        if choice is None:
            b = len(btime)
            btime.append(chunk_time)
            btok.append(0)
        else:
            b = ids.pop(choice)
            del lefts[choice]
        btime[b] += it
        btok[b] += sz
        if btok[b] + smallest <= token_cap:  # a bucket without room for the smallest item is left out
            left = time_budget - btime[b] if by_time else token_cap - btok[b]
            lo = bisect.bisect_left(lefts, left)
            k = bisect.bisect_left(ids, b, lo, bisect.bisect_right(lefts, left, lo))  # ties: by bucket
            lefts.insert(k, left)
            ids.insert(k, b)
        out.append(b)
    return out


@dataclass
class Chunking:
    """The chunks of a batch as arrays, grouped into units (module docstring), in order: each chunk's
    segments ``seg[ptr[k] : ptr[k + 1]]`` (rows ``(sequence, start, end)``), its kind, and the chunks per
    unit. The planner scores many chunkings and makes :class:`Chunk` objects only of those it plans."""

    seg: np.ndarray  # (segments, 3) int64
    ptr: np.ndarray  # (chunks + 1,)
    kinds: np.ndarray  # (chunks,) str
    unit_sizes: np.ndarray  # (units,)

    @property
    def num_units(self) -> int:
        return len(self.unit_sizes)

    def features(self) -> np.ndarray:
        """:func:`chunk_features` of the chunks, from the arrays."""
        n = len(self.ptr) - 1
        owner = np.repeat(np.arange(n), np.diff(self.ptr))
        seg = segment_features(self.seg[:, 2] - self.seg[:, 1], self.seg[:, 1])
        feats = np.stack([np.bincount(owner, weights=seg[:, f], minlength=n) for f in range(NUM_FEATURES)], axis=-1)
        feats[:, F.CHUNKS] = 1.0
        return feats

    def take(self, chunks: np.ndarray, unit_sizes: np.ndarray) -> "Chunking":
        """The chunks at positions ``chunks`` (in that order), grouped into ``unit_sizes``."""
        counts = np.diff(self.ptr)[chunks]
        ptr = np.concatenate([[0], np.cumsum(counts)])
        rows = np.repeat(self.ptr[chunks] - ptr[:-1], counts) + np.arange(ptr[-1])
        return Chunking(self.seg[rows], ptr, self.kinds[chunks], np.asarray(unit_sizes))

    def chunks(self, first_unit: int = 0, end_unit: int | None = None, first_id: int = 0) -> list[Chunk]:
        """:class:`Chunk` objects of units ``[first_unit, end_unit)``, ids from ``first_id``."""
        bounds = np.concatenate([[0], np.cumsum(self.unit_sizes)])
        lo, hi = int(bounds[first_unit]), int(bounds[self.num_units if end_unit is None else end_unit])
        ptr, rows, kinds = self.ptr[lo : hi + 1].tolist(), self.seg.tolist(), self.kinds[lo:hi].tolist()
        return [Chunk(first_id + k, kind, [Segment(*r) for r in rows[a:b]])
                for k, (kind, a, b) in enumerate(zip(kinds, ptr[:-1], ptr[1:]))]


def build_units(
    lengths: np.ndarray,
    w: np.ndarray,
    time_budget: float,
    token_cap: int,
    balance: bool = True,
    cuts: list[np.ndarray] | None = None,
) -> Chunking:
    """Chunk a batch: slice the long sequences and pack the rest. ``cuts`` overrides the slicing
    (sequences with a single slice are then packed); ``balance=False``: even slices, packing by tokens.
    Units: every sliced sequence's slices (the tail's bucket last), then the other buckets."""
    L = np.asarray(lengths, dtype=np.int64)
    seg_feats = sequence_features(L)
    seg_feats[:, F.CHUNKS] = 0.0  # one whole segment, without its chunk's launch constant
    seg = seg_feats @ w
    if cuts is None:
        long = (L > token_cap) | (balance & (seg + w[F.CHUNKS] > time_budget))
        idx = np.flatnonzero(long)
        if balance:
            rows, points = _cut_steps(L[idx], time_budget, token_cap, w)
        else:
            sliced = even_cuts(L[idx], token_cap)
            rows = np.repeat(np.arange(len(idx)), np.array([len(c) - 1 for c in sliced], dtype=np.int64))
            points = np.concatenate([c[1:] for c in sliced]) if sliced else np.zeros(0, dtype=np.int64)
    else:
        idx = np.flatnonzero([len(c) > 2 for c in cuts])
        rows = np.repeat(np.arange(len(idx)), np.array([len(cuts[i]) - 1 for i in idx], dtype=np.int64))
        points = np.concatenate([cuts[i][1:] for i in idx]) if len(idx) else np.zeros(0, dtype=np.int64)
    # slices of the long sequences, in order: every one but the last (the tail) a split chunk
    rows, points = rows.astype(np.int64), points.astype(np.int64)
    first = np.ones(len(rows), dtype=bool)
    first[1:] = rows[1:] != rows[:-1]
    starts = np.where(first, 0, np.roll(points, 1))
    last = np.ones(len(rows), dtype=bool)
    last[:-1] = first[1:]
    split = np.stack([idx[rows[~last]], starts[~last], points[~last]], axis=-1)
    tails = np.stack([idx[rows[last]], starts[last], points[last]], axis=-1)
    T = len(tails)
    short = np.setdiff1d(np.arange(len(L)), idx)
    short = short[np.argsort(-L[short], kind="stable")]
    tl, tc = (tails[:, 2] - tails[:, 1]).astype(float), tails[:, 1].astype(float)
    seed_time = segment_features(tl, tc) @ w if T else np.zeros(0)
    where = pack(L[short], seg[short], seed_time, tl, float(w[F.CHUNKS]), time_budget, token_cap, key="time" if balance else "tokens")
    # buckets: each tail first, then its packed sequences in packing order
    bucket = np.concatenate([np.arange(T), np.asarray(where, dtype=np.int64)])
    order = np.argsort(bucket, kind="stable")
    packed = np.concatenate([tails, np.stack([short, np.zeros_like(short), L[short]], axis=-1)])[order]
    nb = max(T, int(bucket.max(initial=-1)) + 1)
    bucket_size = np.bincount(bucket, minlength=nb)
    bucket_first = np.concatenate([[0], np.cumsum(bucket_size)[:-1]])
    # chunk k: segments [pool_first[k], pool_first[k] + size[k]) of the pool (split slices, then the buckets')
    per_unit = np.bincount(rows, minlength=T)  # a sliced sequence's chunks: its split slices and its tail's bucket
    at_tail = np.cumsum(per_unit) - 1
    pool_first = np.empty(int(per_unit.sum()), dtype=np.int64)
    size = np.ones(len(pool_first), dtype=np.int64)
    is_split = np.ones(len(pool_first), dtype=bool)
    is_split[at_tail] = False
    pool_first[is_split] = np.arange(len(split))
    pool_first[at_tail] = len(split) + bucket_first[:T]
    size[at_tail] = bucket_size[:T]
    pool_first = np.concatenate([pool_first, len(split) + bucket_first[T:]])
    size = np.concatenate([size, bucket_size[T:]])
    ptr = np.concatenate([[0], np.cumsum(size)])
    seg_rows = np.repeat(pool_first - ptr[:-1], size) + np.arange(ptr[-1])
    # kinds as chunk_kind names them: a tail's bucket holds a slice (split alone, hybrid packed), unless the tail is whole
    tail_kind = np.where(tails[:, 1] == 0, "batched", np.where(bucket_size[:T] == 1, "split", "hybrid"))
    kinds = np.full(len(size), "batched", dtype=object)
    kinds[: len(is_split)][is_split] = "split"
    kinds[at_tail] = tail_kind
    unit_sizes = np.concatenate([per_unit, np.ones(nb - T, dtype=np.int64)])
    return Chunking(np.concatenate([split, packed]).astype(np.int64)[seg_rows], ptr, kinds, unit_sizes)
