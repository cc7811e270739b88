"""A chunk's cost features, with named columns: every time and memory quantity of the cost model is
a dot product of these with a profile's coefficients (:meth:`TimeCoeffs.vector` has the same order).

A chunk of segments ``(s_i, C_i)`` (``s`` tokens attending to a prefix of ``C`` earlier tokens of
their sequence) has the features ``[sum s^2, sum s*C, sum s, sum C, segments, chunks]`` where
``chunks`` is 1 (the per-chunk launch constant).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Sequence

import numpy as np

from megatron_epp.plan import Chunk


class F(IntEnum):
    """Column of a feature row."""

    SQ = 0  # sum s^2
    SC = 1  # sum s * C
    S = 2  # sum s: tokens
    C = 3  # sum C: prefix (context) tokens
    SEGMENTS = 4  # number of segments
    CHUNKS = 5  # 1 per chunk: the launch constant


NUM_FEATURES = len(F)


def segment_features(lengths: np.ndarray, contexts: np.ndarray) -> np.ndarray:
    """Features of single segments (one row per segment), as if each were a chunk of its own."""
    s = np.asarray(lengths, dtype=float)
    c = np.asarray(contexts, dtype=float)
    one = np.ones_like(s)
    return np.stack([s * s, s * c, s, c, one, one], axis=-1)


def sequence_features(lengths: np.ndarray) -> np.ndarray:
    """Features of whole sequences, each run as one chunk of one segment (no prefix)."""
    s = np.asarray(lengths, dtype=float)
    return segment_features(s, np.zeros_like(s))


def chunk_features(chunks: Sequence[Chunk]) -> np.ndarray:
    """``(n, NUM_FEATURES)`` features of chunks (segments summed, one launch constant per chunk)."""
    rows = [(c.segments, len(c.segments)) for c in chunks]
    lengths = np.array([s.length for segs, _ in rows for s in segs], dtype=float)
    contexts = np.array([s.start for segs, _ in rows for s in segs], dtype=float)
    owner = np.repeat(np.arange(len(rows)), [n for _, n in rows])
    feats = np.zeros((len(rows), NUM_FEATURES))
    np.add.at(feats, owner, segment_features(lengths, contexts))
    feats[:, F.CHUNKS] = 1.0
    return feats


def padded_features(feats: np.ndarray, multiple: int) -> np.ndarray:
    """``feats`` of chunks each padded at its end to a multiple of ``multiple`` tokens, the padding a segment of
    its own without prefix (what the executor runs under sequence parallelism: ``ChunkView.build``)."""
    pad = -feats[:, F.S] % multiple
    out = feats.copy()
    out[:, F.SQ] += pad * pad
    out[:, F.S] += pad
    out[:, F.SEGMENTS] += pad > 0
    return out
