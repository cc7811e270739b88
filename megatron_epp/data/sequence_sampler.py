"""Global batches of whole documents for elastic pipeline training, sharded across DP ranks.

The sampler walks an endless stream of documents: epoch ``e`` is a permutation, seeded by
``(seed, e)``, of the documents that can train (at least 2 tokens; shorter ones are skipped and
counted). Global batch ``j`` after resuming at ``consumed_samples = k`` holds stream positions
``[k + j * B, k + (j + 1) * B)``, so a resumed iterator continues exactly where an uninterrupted one
was. A document longer than ``seq_length + 1`` tokens (the context cap) is an error unless
``truncate`` is set, which trains its first ``seq_length + 1`` tokens; a document of ``n + 1``
tokens trains as ``tokens = d[:-1]``, ``labels = d[1:]`` of length ``n``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from megatron_epp.data.documents import DocumentSource
from megatron_epp.planner.data_parallel import TOKENS, split_data_parallel


@dataclass(frozen=True)
class TrainingSequence:
    """One document as a training sequence: ``labels`` are ``tokens`` shifted by one."""

    doc_index: int
    tokens: np.ndarray  # int64 (n,)
    labels: np.ndarray  # int64 (n,)


@dataclass(frozen=True)
class GlobalBatch:
    """One step's documents (lengths up front, tokens loaded on request) and their DP ranks."""

    consumed_samples: int  # documents consumed before this batch
    doc_indices: np.ndarray  # (global_batch_size,) indices into the document source
    seq_lengths: np.ndarray  # (global_batch_size,) training-sequence lengths, at most seq_length
    assignment: list[np.ndarray]  # per DP rank: positions into doc_indices
    documents: DocumentSource = field(repr=False, compare=False)

    def positions(self, dp_rank: int | None = None) -> np.ndarray:
        """Positions of ``dp_rank``'s sequences in this batch (all positions for None)."""
        return np.arange(len(self.doc_indices)) if dp_rank is None else self.assignment[dp_rank]

    def sequences(self, dp_rank: int | None = None) -> list[TrainingSequence]:
        """Load the token arrays of ``dp_rank``'s sequences (all sequences for None)."""
        out = []
        for pos in self.positions(dp_rank):
            doc_index = int(self.doc_indices[pos])
            doc = self.documents[doc_index][: self.seq_lengths[pos] + 1]
            out.append(TrainingSequence(doc_index, doc[:-1], doc[1:]))
        return out


class SequenceSampler:
    """Endless, resumable global batches of ``global_batch_size`` whole documents; see the module
    docstring. ``work_vector``: how :func:`split_data_parallel` weighs a sequence (training passes the
    planner's :meth:`CostModel.work_vector`; default: its tokens); ``truncate`` allows documents
    longer than the context cap."""

    def __init__(
        self,
        documents: DocumentSource,
        global_batch_size: int,
        seq_length: int,
        seed: int = 1234,
        dp_size: int = 1,
        work_vector: np.ndarray = TOKENS,
        truncate: bool = False,
    ) -> None:
        if global_batch_size < dp_size:
            raise ValueError(f"global_batch_size {global_batch_size} < dp_size {dp_size}")
        self.documents = documents
        self.global_batch_size = global_batch_size
        self.seq_length = seq_length
        self.seed = seed
        self.dp_size = dp_size
        self.work_vector = work_vector
        lengths = np.asarray(documents.lengths, dtype=np.int64)
        self._trainable = np.flatnonzero(lengths >= 2)
        self.num_skipped = len(lengths) - len(self._trainable)
        if not len(self._trainable):
            raise ValueError(
                f"none of the {len(lengths)} documents has the 2 tokens training needs"
            )
        self._seq_lengths = np.minimum(lengths, seq_length + 1) - 1
        self.num_truncated = int(np.count_nonzero(lengths[self._trainable] > seq_length + 1))
        if self.num_truncated and not truncate:
            raise ValueError(
                f"{self.num_truncated} of {len(self._trainable)} documents are longer than the context cap "
                f"seq_length {seq_length} (longest {int(lengths.max()) - 1} tokens); truncate=True trains "
                "their first seq_length tokens"
            )
        self._cached_epoch: tuple[int, np.ndarray] | None = None

    @property
    def documents_per_epoch(self) -> int:
        return len(self._trainable)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._cached_epoch is None or self._cached_epoch[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self._trainable))
            self._cached_epoch = (epoch, self._trainable[perm])
        return self._cached_epoch[1]

    def stream(self, start: int, count: int) -> np.ndarray:
        """Document indices at stream positions ``[start, start + count)``."""
        positions = np.arange(start, start + count)
        epochs, offsets = np.divmod(positions, len(self._trainable))
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._epoch_order(int(epoch))[offsets[mask]]
        return out

    def iterate(self, consumed_samples: int = 0) -> Iterator[GlobalBatch]:
        """Global batches from stream position ``consumed_samples`` on, without end."""
        consumed = consumed_samples
        while True:
            doc_indices = self.stream(consumed, self.global_batch_size)
            seq_lengths = self._seq_lengths[doc_indices]
            assignment = split_data_parallel(seq_lengths, self.dp_size, self.work_vector)
            yield GlobalBatch(consumed, doc_indices, seq_lengths, assignment, self.documents)
            consumed += self.global_batch_size

    def __iter__(self) -> Iterator[GlobalBatch]:
        return self.iterate(0)
