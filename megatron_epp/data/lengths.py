"""The sequence lengths the planner plans: a lengths file (one token count per line, ``.gz`` allowed) and a
global batch sampled from it, shared by ``epp-plan``, ``pretrain_gpt.py --epp-search-layout`` and the mock
documents (:func:`megatron_epp.data.mock_documents.lengths_from_file`). Numpy only: the data layer's module that
the torch-free planner may import (lengths are data; the flow is lengths -> planner)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np


def read_lengths(path: str | Path) -> np.ndarray:
    """One positive token count per line; ``.gz`` allowed; blank lines ignored. A file that cannot be
    read, holds no count, or a line that is not one, is a one-line ``ValueError`` naming the file (and the line)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as error:  # missing, unreadable, a bad .gz, not text
        raise ValueError(f"lengths file {path}: {getattr(error, 'strerror', None) or error}") from None
    try:
        lengths = np.array([int(x) for x in text.split()], dtype=np.int64)
    except (ValueError, OverflowError):
        lengths = np.zeros(1, dtype=np.int64)  # a word that is not an int64: found below
    if (lengths < 1).any():
        number, word = next((i, w) for i, line in enumerate(text.splitlines(), 1) for w in line.split() if not _is_count(w))
        raise ValueError(f"lengths file {path}: line {number}: {word!r} is not a positive token count (one per line)")
    if not len(lengths):
        raise ValueError(f"lengths file {path}: no lengths (one token count per line)")
    return lengths


def _is_count(word: str) -> bool:
    try:
        return 0 < int(word) < 2**63
    except ValueError:
        return False


def select_batch(lengths: np.ndarray, gbs: int | None, seed: int, max_seq_len: int, truncate: bool) -> np.ndarray:
    """Sample ``gbs`` lengths (without replacement when possible; None: all of them); lengths over
    ``max_seq_len`` are cut to it with ``truncate``, else a ``ValueError``."""
    if gbs is not None:
        rng = np.random.default_rng(seed)
        lengths = rng.choice(lengths, size=gbs, replace=gbs > len(lengths))
    too_long = lengths > max_seq_len
    if too_long.any():
        if not truncate:
            raise ValueError(f"{int(too_long.sum())} document(s) longer than the cap (longest {int(lengths.max())} tokens)")
        lengths = np.minimum(lengths, max_seq_len)
    return lengths
