"""Fixed-length GPT samples (Megatron GPTDataset semantics) and their mock equivalent."""

import numpy as np
import pytest
import torch

from megatron_epp.data.gpt_samples import GPTSamples, MockGPTSamples
from megatron_epp.data.mock_documents import MockDocuments

SEQ = 16
DOCS = MockDocuments(np.array([5, 40, 0, 13, 27, 3, 60]), vocab_size=50, seed=7)


def stream_of_epoch(seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(len(DOCS))
    return np.concatenate([DOCS[int(i)] for i in order])


def test_samples_cover_the_shuffled_stream():
    samples = GPTSamples(DOCS, SEQ, seed=3)
    stream = stream_of_epoch(3, 0)
    assert len(samples) == (len(stream) - 1) // SEQ
    for i in range(len(samples)):
        s = samples[i]
        assert {k: v.shape for k, v in s.items()} == {k: (SEQ,) for k in s}
        assert torch.equal(s["tokens"], torch.from_numpy(stream[i * SEQ : (i + 1) * SEQ]))
        assert torch.equal(s["labels"], torch.from_numpy(stream[i * SEQ + 1 : (i + 1) * SEQ + 1]))
        assert torch.equal(s["position_ids"], torch.arange(SEQ))
        assert s["loss_mask"].sum() == SEQ
    with pytest.raises(IndexError):
        samples[len(samples)]


def test_determinism_and_epochs():
    a, b, c = (GPTSamples(DOCS, SEQ, seed=s, num_samples=30) for s in (1, 1, 2))
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(30))
    assert any(not torch.equal(a[i]["tokens"], c[i]["tokens"]) for i in range(30))
    # 30 samples need 30 * 16 + 1 tokens = 4 epochs of 148; epoch e is reshuffled with (seed, e)
    stream = np.concatenate([stream_of_epoch(1, e) for e in range(4)])
    assert torch.equal(a[29]["labels"], torch.from_numpy(stream[29 * SEQ + 1 : 30 * SEQ + 1]))


def test_too_few_tokens():
    with pytest.raises(ValueError, match="cannot fill one sample"):
        GPTSamples(MockDocuments(np.array([4, 4]), 50), SEQ)


def test_mock_samples_are_deterministic_progressions():
    mock = MockGPTSamples(SEQ, vocab_size=97, seed=5, num_samples=100)
    again = MockGPTSamples(SEQ, vocab_size=97, seed=5, num_samples=100)
    assert len(mock) == 100
    s = mock[42]
    assert torch.equal(s["tokens"], again[42]["tokens"])
    assert not torch.equal(s["tokens"], mock[43]["tokens"])
    full = torch.cat([s["tokens"], s["labels"][-1:]])
    steps = torch.remainder(full[1:] - full[:-1], 97)
    assert (steps == steps[0]).all() and steps[0] != 0
    assert int(full.max()) < 97
