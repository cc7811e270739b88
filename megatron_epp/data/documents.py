"""Whole-document access to a Megatron indexed dataset, and train/valid/test document splits."""

from __future__ import annotations

from typing import Protocol

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split


class DocumentSource(Protocol):
    """Documents as int64 token arrays; what the sample builders and the sampler consume."""

    @property
    def lengths(self) -> np.ndarray: ...  # int64 token count per document

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...


def split_ranges(num_docs: int, split: str) -> dict[str, range]:
    """Megatron's split string (e.g. ``"969,30,1"``; weights normalised, missing ones 0) as
    contiguous document index ranges ``{"train", "valid", "test"}``."""
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    bounds = [(0.0, 0.0) if b is None else b for b in matrix]
    return {
        s.name: range(int(round(lo * num_docs)), int(round(hi * num_docs)))
        for s, (lo, hi) in zip(Split, bounds)
    }


class IndexedDocuments:
    """A document source backed by a ``_lengths`` array: ``lengths``, ``len`` and a bounds-checked
    ``[i]`` that subclasses fill in through ``_document``."""

    _lengths: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} out of range ({len(self)} documents)")
        return self._document(index)

    def _document(self, index: int) -> np.ndarray:
        raise NotImplementedError


class DocumentDataset(IndexedDocuments):
    """Documents ``doc_range`` (default: all) of the indexed dataset at ``prefix``.

    A document spans the dataset's sequences between consecutive ``document_indices`` (one
    sequence per document for data written by ``prepare_dataset``); its tokens include the
    end-of-document id.
    """

    def __init__(self, prefix: str, doc_range: range | None = None) -> None:
        if not IndexedDataset.exists(prefix):
            raise FileNotFoundError(
                f"indexed dataset not found: {prefix}.bin/.idx "
                "(build it with scripts/prepare_data.py)"
            )
        self.prefix = prefix
        self._dataset = IndexedDataset(prefix)
        doc_bounds = self._dataset.document_indices.astype(np.int64)
        seq_ends = np.concatenate([[0], np.cumsum(self._dataset.sequence_lengths, dtype=np.int64)])
        all_lengths = seq_ends[doc_bounds[1:]] - seq_ends[doc_bounds[:-1]]
        self.doc_range = range(len(all_lengths)) if doc_range is None else doc_range
        if self.doc_range.step != 1 or not (
            0 <= self.doc_range.start <= self.doc_range.stop <= len(all_lengths)
        ):
            raise ValueError(f"doc_range {doc_range} outside the {len(all_lengths)} documents")
        selected = slice(self.doc_range.start, self.doc_range.stop)
        self._first_sequence = doc_bounds[:-1][selected]
        self._lengths = all_lengths[selected]

    def _document(self, index: int) -> np.ndarray:
        tokens = self._dataset.get(int(self._first_sequence[index]), 0, int(self._lengths[index]))
        return tokens.astype(np.int64)

    def split(self, split: str) -> dict[str, DocumentDataset]:
        """This dataset's documents divided by a Megatron split string, e.g. ``"969,30,1"``."""
        return {
            name: DocumentDataset(
                self.prefix, range(self.doc_range.start + r.start, self.doc_range.start + r.stop)
            )
            for name, r in split_ranges(len(self), split).items()
        }
