"""Whole-document access to a Megatron indexed dataset, and train/valid/test document splits.

A dataset of conversations (``epp-prepare-data --sft``) has its per-token loss masks beside it, a second indexed
dataset at :func:`loss_mask_prefix` (uint8, one entry per document of the same length); ``DocumentDataset(prefix,
loss_masks=True)`` reads them along and refuses, in one line, masks that are missing or do not align with the tokens.
"""

from __future__ import annotations

import os
import struct
from typing import Protocol

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType, IndexedDataset
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


LOSS_MASK_SUFFIX = "_loss_mask"


def loss_mask_prefix(prefix: str) -> str:
    """Where the loss masks of the dataset at ``prefix`` are (``PREFIX_loss_mask.bin/.idx``)."""
    return f"{prefix}{LOSS_MASK_SUFFIX}"


class IndexMismatch(ValueError):
    """A ``.bin``/``.idx`` pair that cannot be read together (one line: what does not match)."""


class LossMaskMismatch(IndexMismatch):
    """Loss masks that are missing or do not align with their dataset's tokens (one line)."""


def check_indexed_dataset(prefix: str) -> None:
    """Raise :class:`IndexMismatch` unless ``prefix.idx`` is a Megatron index (magic, version 1, a known
    dtype, its arrays whole) that describes ``prefix.bin`` byte for byte (megatron-core would only fail,
    or read garbage, at the first sample past the end)."""
    idx, bin_ = f"{prefix}.idx", f"{prefix}.bin"
    with open(idx, "rb") as f:
        header = f.read(34)
    if len(header) < 34 or header[:9] != _INDEX_HEADER:
        raise IndexMismatch(f"{idx}: not a Megatron indexed-dataset index (bad magic)")
    version, code, sequences, documents = struct.unpack("<QBQQ", header[9:])
    if version != 1:
        raise IndexMismatch(f"{idx}: index version {version}, only version 1 is read")
    if code not in {d.value for d in DType}:
        raise IndexMismatch(f"{idx}: unknown token dtype code {code}")
    needed = 34 + sequences * (4 + 8) + documents * 8
    if os.path.getsize(idx) < needed:
        raise IndexMismatch(f"{idx}: {os.path.getsize(idx)} bytes, its header ({sequences} sequences, "
                            f"{documents} document bounds) needs {needed}")
    itemsize = DType.size(DType.dtype_from_code(code))
    lengths = np.fromfile(idx, np.int32, sequences, offset=34)
    pointers = np.fromfile(idx, np.int64, sequences, offset=34 + 4 * sequences)
    expected = int(pointers[-1]) + int(lengths[-1]) * itemsize if sequences else 0
    actual = os.path.getsize(bin_)
    if actual != expected:
        raise IndexMismatch(f"{bin_}: {actual} bytes, but {idx} describes {expected} "
                            f"({sequences} sequences of {DType.dtype_from_code(code).__name__}): not its index")


class IndexedDocuments:
    """A document source backed by a ``_lengths`` array: ``lengths``, ``len`` and a bounds-checked
    ``[i]`` that subclasses fill in through ``_document``."""

    _lengths: np.ndarray
    has_loss_masks = False  # whether :meth:`loss_mask` gives each document's per-token loss mask

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def loss_mask(self, index: int) -> np.ndarray:
        """Document ``index``'s per-token loss mask (uint8, its length; 1: trained), where :attr:`has_loss_masks`."""
        raise TypeError(f"{type(self).__name__} has no loss masks")

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

    def __init__(self, prefix: str, doc_range: range | None = None, loss_masks: bool = False) -> None:
        if not IndexedDataset.exists(prefix):
            raise FileNotFoundError(
                f"indexed dataset not found: {prefix}.bin/.idx "
                "(build it with python -m megatron_epp.data.prepare)"
            )
        check_indexed_dataset(prefix)
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
        self.has_loss_masks = loss_masks
        self._masks = _aligned_masks(prefix, self._dataset, all_lengths, self.doc_range) if loss_masks else None

    def _document(self, index: int) -> np.ndarray:
        tokens = self._dataset.get(int(self._first_sequence[index]), 0, int(self._lengths[index]))
        return tokens.astype(np.int64)

    def loss_mask(self, index: int) -> np.ndarray:
        if self._masks is None:
            return super().loss_mask(index)
        return self._masks[index]

    def split(self, split: str) -> dict[str, DocumentDataset]:
        """This dataset's documents divided by a Megatron split string, e.g. ``"969,30,1"``."""
        return {
            name: DocumentDataset(
                self.prefix, range(self.doc_range.start + r.start, self.doc_range.start + r.stop), self.has_loss_masks
            )
            for name, r in split_ranges(len(self), split).items()
        }


def _aligned_masks(prefix: str, tokens: IndexedDataset, lengths: np.ndarray, doc_range: range) -> "DocumentDataset":
    """The loss masks of the dataset at ``prefix`` (its ``tokens`` with document ``lengths``), documents ``doc_range``;
    :class:`LossMaskMismatch` when they are missing or are not one uint8 entry per document of the same length."""
    masks = loss_mask_prefix(prefix)
    if not IndexedDataset.exists(masks):
        raise LossMaskMismatch(f"{masks}.bin/.idx not found: --sft trains on the loss masks of conversations; prepare "
                               f"the data with epp-prepare-data --sft")
    check_indexed_dataset(masks)
    mask_data = DocumentDataset(masks)
    if mask_data._dataset.index.dtype != np.uint8:
        raise LossMaskMismatch(f"{masks}.idx: tokens of {mask_data._dataset.index.dtype.__name__}, not the uint8 of loss masks")
    if len(mask_data) != len(lengths) or not np.array_equal(mask_data.lengths, lengths):
        first = next((i for i, (a, b) in enumerate(zip(mask_data.lengths, lengths)) if a != b), min(len(mask_data), len(lengths)))
        raise LossMaskMismatch(f"{masks}: {len(mask_data)} documents, {prefix}: {len(lengths)}; they differ from document "
                               f"{first} on: not the loss masks of these tokens")
    return DocumentDataset(masks, doc_range)
