"""The sequence lengths the planner plans: a lengths file (one token count per line, ``.gz`` allowed) and a
global batch sampled from it, shared by ``epp-plan``, ``pretrain_gpt.py --epp-search-layout`` and the mock
documents (:func:`megatron_epp.data.mock_documents.lengths_from_file`)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np


def read_lengths(path: str | Path) -> np.ndarray:
    """One length per line; ``.gz`` allowed; blank lines ignored."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return np.array([int(x) for x in f.read().split()], dtype=np.int64)


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
