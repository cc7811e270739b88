"""Global batches of whole documents for elastic pipeline training, sharded across DP ranks.

The sampler walks an endless stream of documents: epoch ``e`` is a permutation, seeded by
``(seed, e)``, of the documents that can train (at least 2 tokens; shorter ones are skipped and
counted). Global batch ``j`` after resuming at ``consumed_samples = k`` holds stream positions
``[k + j * B, k + (j + 1) * B)``, so a resumed iterator continues exactly where an uninterrupted one
was. A document longer than ``seq_length + 1`` tokens (the context cap) is an error unless
``truncate`` is set, which trains its first ``seq_length + 1`` tokens; a document of ``n + 1``
tokens trains as ``tokens = d[:-1]``, ``labels = d[1:]`` of length ``n``. A document source with loss masks (``--sft``:
conversations, :meth:`~megatron_epp.data.documents.IndexedDocuments.loss_mask`) gives each sequence the masks of its
labels, ``m[1:]`` (label ``j`` is token ``j + 1``), truncated with it; without them every label trains.

Over :class:`~megatron_epp.data.blend.BlendedDocuments` (``--data-path 0.3 A 0.7 B``) the stream position
first picks a dataset by megatron-core's blending indices (:class:`~megatron_epp.data.blend.BlendIndex`) and
then that dataset's next whole document from its own endless stream (epoch ``e`` of dataset ``d``: a
permutation seeded by ``(seed, d, e)``): still a pure function of the position, so resuming is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from megatron_epp.data.blend import BlendedDocuments, BlendIndex
from megatron_epp.data.documents import DocumentSource

# how a global batch's sequences are dealt to the data-parallel replicas: (sequence lengths, dp size) -> per replica
# the ascending positions of its sequences (training passes the planner's dp_split on its cost model)
DpSplit = Callable[[np.ndarray, int], list[np.ndarray]]


@dataclass(frozen=True)
class TrainingSequence:
    """One document as a training sequence: ``labels`` are ``tokens`` shifted by one; ``loss_mask``: which labels train
    (None: all)."""

    doc_index: int
    tokens: np.ndarray  # int64 (n,)
    labels: np.ndarray  # int64 (n,)
    loss_mask: np.ndarray | None = None  # (n,) 1: label j trains (the document's mask of token j + 1)


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
        masked = getattr(self.documents, "has_loss_masks", False)
        for pos in self.positions(dp_rank):
            doc_index = int(self.doc_indices[pos])
            end = self.seq_lengths[pos] + 1
            doc = self.documents[doc_index][:end]
            mask = self.documents.loss_mask(doc_index)[1:end] if masked else None
            out.append(TrainingSequence(doc_index, doc[:-1], doc[1:], mask))
        return out


class SequenceSampler:
    """Endless, resumable global batches of ``global_batch_size`` whole documents; see the module
    docstring. ``dp_split``: how a global batch is dealt to the ``dp_size`` replicas (:data:`DpSplit`; training
    passes the planner's data-parallel split on its cost model), needed when ``dp_size`` > 1; ``truncate``
    allows documents longer than the context cap."""

    def __init__(
        self,
        documents: DocumentSource,
        global_batch_size: int,
        seq_length: int,
        seed: int = 1234,
        dp_size: int = 1,
        dp_split: DpSplit | None = None,
        truncate: bool = False,
    ) -> None:
        if global_batch_size < dp_size:
            raise ValueError(f"global_batch_size {global_batch_size} < dp_size {dp_size}")
        if dp_split is None and dp_size > 1:
            raise ValueError(f"dp_size {dp_size}: the sampler needs the data-parallel split (dp_split=)")
        self.documents = documents
        self.global_batch_size = global_batch_size
        self.seq_length = seq_length
        self.seed = seed
        self.dp_size = dp_size
        self.dp_split = dp_split
        lengths = np.asarray(documents.lengths, dtype=np.int64)
        blended = isinstance(documents, BlendedDocuments)
        parts = documents.parts if blended else [range(len(lengths))]
        self._groups = [np.flatnonzero(lengths[p.start:p.stop] >= 2) + p.start for p in parts]
        self._blend = BlendIndex(documents.weights) if blended else None
        trainable = np.concatenate(self._groups)
        self.num_skipped = len(lengths) - len(trainable)
        if not len(trainable):
            raise ValueError(
                f"none of the {len(lengths)} documents has the 2 tokens training needs"
            )
        empty = [g for g, group in enumerate(self._groups) if not len(group)]
        if empty:
            raise ValueError(f"blended dataset {empty[0]} has none of the 2-token documents training needs")
        self._seq_lengths = np.minimum(lengths, seq_length + 1) - 1
        self.num_truncated = int(np.count_nonzero(lengths[trainable] > seq_length + 1))
        if self.num_truncated and not truncate:
            raise ValueError(
                f"{self.num_truncated} of {len(trainable)} documents are longer than the context cap "
                f"seq_length {seq_length} (longest {int(lengths.max()) - 1} tokens); truncate=True trains "
                "their first seq_length tokens"
            )
        self._cached_epochs: dict[int, tuple[int, np.ndarray]] = {}

    @property
    def documents_per_epoch(self) -> int:
        return sum(len(g) for g in self._groups)

    def _epoch_order(self, group: int, epoch: int) -> np.ndarray:
        cached = self._cached_epochs.get(group)
        if cached is None or cached[0] != epoch:
            key = [self.seed, epoch] if self._blend is None else [self.seed, group, epoch]
            perm = np.random.default_rng(key).permutation(len(self._groups[group]))
            self._cached_epochs[group] = cached = (epoch, self._groups[group][perm])
        return cached[1]

    def _group_stream(self, group: int, positions: np.ndarray) -> np.ndarray:
        """Document indices at ``group``'s own stream ``positions`` (epoch after epoch of its documents)."""
        epochs, offsets = np.divmod(positions, len(self._groups[group]))
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._epoch_order(group, int(epoch))[offsets[mask]]
        return out

    def stream(self, start: int, count: int) -> np.ndarray:
        """Document indices at stream positions ``[start, start + count)``."""
        if self._blend is None:
            return self._group_stream(0, np.arange(start, start + count))
        groups, draws = self._blend.locate(start, count)
        out = np.empty(count, dtype=np.int64)
        for group in np.unique(groups):
            mask = groups == group
            out[mask] = self._group_stream(int(group), draws[mask])
        return out

    def iterate(self, consumed_samples: int = 0) -> Iterator[GlobalBatch]:
        """Global batches from stream position ``consumed_samples`` on, without end."""
        consumed = consumed_samples
        while True:
            doc_indices = self.stream(consumed, self.global_batch_size)
            seq_lengths = self._seq_lengths[doc_indices]
            assignment = self.dp_split(seq_lengths, self.dp_size) if self.dp_split is not None else [np.arange(len(seq_lengths))]
            yield GlobalBatch(consumed, doc_indices, seq_lengths, assignment, self.documents)
            consumed += self.global_batch_size

    def __iter__(self) -> Iterator[GlobalBatch]:
        return self.iterate(0)
