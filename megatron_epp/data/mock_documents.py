"""Synthetic data with a learnable token pattern: arithmetic progressions modulo the vocabulary.

Each sequence is ``(start + step * i) % vocab_size`` with a random ``start`` and a small random
``step`` (1..MAX_STEP): a token's successor is one of a few, and after two tokens the rest is
predictable, so even a tiny model's loss falls within a few dozen steps.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from megatron_epp.data.documents import IndexedDocuments
from megatron_epp.data.lengths import read_lengths

MAX_STEP = 3

# The project's shared data sets lie in ``shared/`` beside the checkout (EPP_SHARED_DIR overrides).
SHARED_DIR = Path(os.environ.get("EPP_SHARED_DIR", Path(__file__).resolve().parents[3] / "shared"))
WIKIPEDIA_LENGTHS = SHARED_DIR / "datasets" / "wikipedia_lengths.txt.gz"  # 1M tokenized document lengths


def progression_tokens(rng: np.random.Generator, length: int, vocab_size: int) -> np.ndarray:
    """An int64 arithmetic progression mod ``vocab_size`` with random start and step 1..MAX_STEP."""
    start = rng.integers(0, vocab_size)
    step = rng.integers(1, MAX_STEP + 1)
    return (start + step * np.arange(length, dtype=np.int64)) % vocab_size


def lognormal_lengths(
    num_docs: int, median: int, sigma: float, max_length: int, seed: int
) -> np.ndarray:
    """Skewed document lengths: lognormal around ``median``, clipped to ``[2, max_length]``."""
    rng = np.random.default_rng([seed, 0x1E9])
    raw = rng.lognormal(np.log(median), sigma, size=num_docs)
    return np.clip(np.rint(raw), 2, max_length).astype(np.int64)


def lengths_from_file(
    path: str | Path, num_docs: int, seed: int, scale: float = 1.0, max_length: int | None = None
) -> np.ndarray:
    """``num_docs`` lengths drawn (with replacement) from a lengths file (:func:`~megatron_epp.data.lengths.read_lengths`:
    one length per line, ``.gz`` allowed, e.g. ``wikipedia_lengths.txt.gz``), multiplied by ``scale`` and clipped to
    ``[2, max_length]``."""
    drawn = np.random.default_rng([seed, 0xF11E]).choice(read_lengths(path), size=num_docs) * scale
    return np.clip(np.rint(drawn), 2, max_length).astype(np.int64)


class MockDocuments(IndexedDocuments):
    """Deterministic variable-length documents with lengths ``lengths`` (a ``DocumentSource``);
    document ``i`` is a progression drawn from ``seed`` and ``i`` alone."""

    def __init__(self, lengths: np.ndarray, vocab_size: int, seed: int = 1234) -> None:
        self._lengths = np.asarray(lengths, dtype=np.int64)
        self.vocab_size = vocab_size
        self.seed = seed

    def _document(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        return progression_tokens(rng, int(self._lengths[index]), self.vocab_size)
