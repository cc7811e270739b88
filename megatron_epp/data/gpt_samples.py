"""Fixed-length GPT samples for the classic (non-elastic) Megatron path.

Semantics follow Megatron's GPTDataset: per epoch the documents are shuffled (seeded by
``(seed, epoch)``) and concatenated into one token stream; sample ``i`` is the ``seq_length + 1``
tokens starting at ``i * seq_length`` (consecutive samples share one token), and it becomes
``tokens = s[:-1]``, ``labels = s[1:]``, ``loss_mask`` ones (zero where the input token is the end-of-document id
under ``--eod-mask-loss``) and ``position_ids`` ``arange``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from megatron_epp.data.documents import DocumentSource
from megatron_epp.data.mock_documents import progression_tokens


def sample_dict(sample: np.ndarray, eod_mask: int | None = None) -> dict[str, torch.Tensor]:
    """Megatron's batch fields for one sample of ``seq_length + 1`` token ids; ``eod_mask``: the end-of-document id
    whose following token gets no loss (Megatron's ``eod_mask_loss``: ``loss_mask[tokens == eod] = 0``)."""
    sample = torch.as_tensor(np.asarray(sample, dtype=np.int64))
    n = sample.numel() - 1
    tokens = sample[:-1].clone()
    loss_mask = torch.ones(n, dtype=torch.float32)
    if eod_mask is not None:
        loss_mask[tokens == eod_mask] = 0.0
    return {
        "tokens": tokens,
        "labels": sample[1:].clone(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(n, dtype=torch.int64),
    }


class GPTSamples(torch.utils.data.Dataset):
    """Samples over ``documents``; ``num_samples`` (default: what one epoch yields) decides how
    many epochs the stream spans."""

    def __init__(
        self,
        documents: DocumentSource,
        seq_length: int,
        seed: int = 1234,
        num_samples: int | None = None,
        eod_mask: int | None = None,
    ) -> None:
        self.documents = documents
        self.eod_mask = eod_mask
        self.seq_length = seq_length
        tokens_per_epoch = int(documents.lengths.sum())
        if tokens_per_epoch < seq_length + 1:
            raise ValueError(
                f"{tokens_per_epoch} tokens cannot fill one sample of {seq_length + 1} tokens"
            )
        if num_samples is None:
            num_epochs = 1
            num_samples = (tokens_per_epoch - 1) // seq_length
        else:
            num_epochs = math.ceil((num_samples * seq_length + 1) / tokens_per_epoch)
        self.num_samples = num_samples
        self._order = np.concatenate(
            [
                np.random.default_rng([seed, e]).permutation(len(documents))
                for e in range(num_epochs)
            ]
        )
        self._ends = np.cumsum(documents.lengths[self._order])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range ({self.num_samples} samples)")
        pos = index * self.seq_length
        stop = pos + self.seq_length + 1
        k = int(np.searchsorted(self._ends, pos, side="right"))
        pieces = []
        while pos < stop:
            doc = self.documents[int(self._order[k])]
            doc_start = int(self._ends[k]) - len(doc)
            pieces.append(doc[pos - doc_start : min(stop, int(self._ends[k])) - doc_start])
            pos += len(pieces[-1])
            k += 1
        return sample_dict(np.concatenate(pieces), self.eod_mask)


class MockGPTSamples(torch.utils.data.Dataset):
    """``num_samples`` cheap deterministic samples: sample ``i`` is a progression
    (see ``mock_documents``) drawn from ``seed`` and ``i`` alone."""

    def __init__(
        self, seq_length: int, vocab_size: int, seed: int = 1234, num_samples: int = 1_000_000, eod_mask: int | None = None
    ) -> None:
        self.seq_length = seq_length
        self.eod_mask = eod_mask
        self.vocab_size = vocab_size
        self.seed = seed
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range ({self.num_samples} samples)")
        rng = np.random.default_rng([self.seed, index])
        return sample_dict(progression_tokens(rng, self.seq_length + 1, self.vocab_size), self.eod_mask)
