"""Blended datasets: Megatron's ``--data-path 0.3 A 0.7 B`` (a weight before each prefix).

Which dataset stream position ``i`` draws from follows megatron-core's ``BlendedDataset``: its greedy
blending indices (``helpers.build_blending_indices``: each position goes to the dataset furthest below
its share ``weight x position``), so any prefix of the stream holds each dataset in proportion to its
weight, to within one draw. Here they are built once for a block of :data:`BLOCK` positions and
repeated: position ``i`` is block ``i // BLOCK``'s entry ``i % BLOCK``, and dataset ``d``'s draw counter
advances by its per-block count each block. The stream is then endless, a pure function of the position
(resuming at ``consumed_samples`` continues it exactly) and costs one block of memory.

Each dataset's draws are its own stream: whole documents for ``--elastic-pp`` (:class:`BlendedDocuments`
with :class:`~megatron_epp.data.sequence_sampler.SequenceSampler`), fixed-length samples for the stock
path (:class:`BlendedSamples` over :class:`~megatron_epp.data.gpt_samples.GPTSamples`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from megatron.core.datasets import helpers

from megatron_epp.data.data_path import Blend, BlendError
from megatron_epp.data.documents import DocumentDataset, DocumentSource, IndexedDocuments, split_ranges

BLOCK = 1 << 16  # stream positions per repeated block of blending indices


class BlendIndex:
    """Which dataset, and which of its draws, each stream position is (see the module docstring)."""

    def __init__(self, weights: Sequence[float], block: int = BLOCK) -> None:
        if len(weights) >= np.iinfo(np.int16).max:
            raise BlendError(f"{len(weights)} datasets: megatron-core's blending indices hold fewer than 32767")
        self.block = block
        self.dataset_index = np.zeros(block, dtype=np.int16)
        self.dataset_sample_index = np.zeros(block, dtype=np.int64)
        helpers.build_blending_indices(
            self.dataset_index, self.dataset_sample_index, np.asarray(weights, dtype=np.float64), len(weights), block, False
        )
        self.per_block = np.bincount(self.dataset_index, minlength=len(weights)).astype(np.int64)

    def locate(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """For stream positions ``[start, start + count)``: the dataset of each and its draw number there."""
        blocks, offsets = np.divmod(np.arange(start, start + count, dtype=np.int64), self.block)
        datasets = self.dataset_index[offsets].astype(np.int64)
        return datasets, blocks * self.per_block[datasets] + self.dataset_sample_index[offsets]

    def counts(self, n: int) -> np.ndarray:
        """Draws of each dataset among the first ``n`` stream positions."""
        full, rest = divmod(n, self.block)
        return full * self.per_block + np.bincount(self.dataset_index[:rest], minlength=len(self.per_block))


def split_documents(prefix: str, split: str, name: str, loss_masks: bool = False) -> DocumentDataset:
    """The ``name`` ('train', 'valid', 'test') documents of the dataset at ``prefix`` under ``--split`` (with their loss
    masks: ``--sft``)."""
    whole = DocumentDataset(prefix)
    return DocumentDataset(prefix, split_ranges(len(whole), split)[name], loss_masks)


class BlendedDocuments(IndexedDocuments):
    """Several document sources as one (indices concatenated) with their blend weights: what
    :class:`~megatron_epp.data.sequence_sampler.SequenceSampler` draws whole documents from by weight."""

    def __init__(self, sources: Sequence[DocumentSource], weights: Sequence[float]) -> None:
        if len(sources) != len(weights):
            raise ValueError(f"{len(sources)} sources but {len(weights)} weights")
        self.sources = list(sources)
        self.weights = tuple(weights)
        sizes = [len(s) for s in self.sources]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.parts = [range(int(a), int(b)) for a, b in zip(self.offsets[:-1], self.offsets[1:])]
        self._lengths = np.concatenate([np.asarray(s.lengths, dtype=np.int64) for s in self.sources])
        self.has_loss_masks = all(getattr(s, "has_loss_masks", False) for s in self.sources)

    def _locate(self, index: int) -> tuple[DocumentSource, int]:
        source = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.sources[source], index - int(self.offsets[source])

    def _document(self, index: int) -> np.ndarray:
        source, at = self._locate(index)
        return source[at]

    def loss_mask(self, index: int) -> np.ndarray:
        source, at = self._locate(index)
        return source.loss_mask(at)


def blended_documents(blend: Blend, split: str, name: str, loss_masks: bool = False) -> DocumentSource | None:
    """Split ``name``'s documents of ``blend`` (with their loss masks: ``--sft``): a :class:`DocumentDataset`, a
    :class:`BlendedDocuments`, or None when the split holds no document (of any dataset)."""
    sources = [split_documents(p, split, name, loss_masks) for p in blend.prefixes]
    if not sum(len(s) for s in sources):
        return None
    return sources[0] if blend.weights is None else BlendedDocuments(sources, blend.weights)


class BlendedSamples(torch.utils.data.Dataset):
    """``num_samples`` fixed-length samples drawn from ``datasets`` by weight; ``make(d, n)`` builds dataset
    ``d``'s sample source holding (at least) its ``n`` draws."""

    def __init__(self, make, weights: Sequence[float], num_samples: int) -> None:
        self.index = BlendIndex(weights)
        self.num_samples = num_samples
        self.datasets = [make(d, int(n)) for d, n in enumerate(self.index.counts(num_samples))]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range ({self.num_samples} samples)")
        (dataset,), (draw,) = self.index.locate(index, 1)
        return self.datasets[int(dataset)][int(draw)]
