"""Whole-document global batches: determinism, resume, truncation, skipping, DP balance."""

import gzip
import functools
import itertools

import numpy as np
import pytest

from megatron_epp.data.mock_documents import MockDocuments, lengths_from_file, lognormal_lengths
from megatron_epp.data.sequence_sampler import SequenceSampler
from megatron_epp.planner.data_parallel import TOKENS, dp_split

BY_TOKENS = functools.partial(dp_split, work_vector=TOKENS)  # training injects the planner's split

SEQ = 512
LENGTHS = lognormal_lengths(300, median=120, sigma=1.3, max_length=4 * SEQ, seed=0)
LENGTHS[[3, 50, 77]] = [0, 1, 0]  # cannot train: skipped
DOCS = MockDocuments(LENGTHS, vocab_size=100, seed=1)


def make_sampler(**kw) -> SequenceSampler:
    return SequenceSampler(
        DOCS, **{"global_batch_size": 16, "seq_length": SEQ, "seed": 9, "dp_size": 4, "dp_split": BY_TOKENS, "truncate": True, **kw}
    )


def take(sampler: SequenceSampler, n: int, consumed: int = 0):
    return list(itertools.islice(sampler.iterate(consumed), n))


def test_deterministic_and_seed_dependent():
    a, b = take(make_sampler(), 5), take(make_sampler(), 5)
    c = take(make_sampler(seed=10), 5)
    assert all(np.array_equal(x.doc_indices, y.doc_indices) for x, y in zip(a, b))
    assert all(
        np.array_equal(r, s) for x, y in zip(a, b) for r, s in zip(x.assignment, y.assignment)
    )
    assert not all(np.array_equal(x.doc_indices, z.doc_indices) for x, z in zip(a, c))


def test_epochs_are_permutations_of_trainable_documents():
    sampler = make_sampler()
    n = sampler.documents_per_epoch
    assert n == len(LENGTHS) - 3 and sampler.num_skipped == 3
    stream = np.concatenate([b.doc_indices for b in take(sampler, -(-2 * n // 16))])
    trainable = np.flatnonzero(LENGTHS >= 2)
    for epoch in (stream[:n], stream[n : 2 * n]):
        assert np.array_equal(np.sort(epoch), trainable)
    assert not np.array_equal(stream[:n], stream[n : 2 * n])


def test_resume_equals_uninterrupted():
    full = take(make_sampler(), 30)  # crosses the epoch boundary at 297 documents
    resumed = take(make_sampler(), 20, consumed=full[10].consumed_samples)
    assert full[10].consumed_samples == 160
    for x, y in zip(full[10:], resumed):
        assert x.consumed_samples == y.consumed_samples
        assert np.array_equal(x.doc_indices, y.doc_indices)
        assert np.array_equal(x.seq_lengths, y.seq_lengths)
    # a resume point that is not a batch boundary continues the same document stream
    odd = take(make_sampler(), 2, consumed=165)
    flat = np.concatenate([b.doc_indices for b in full])
    assert np.array_equal(np.concatenate([b.doc_indices for b in odd]), flat[165:197])


def test_too_long_documents_need_truncate_and_truncated_sequences():
    expected = int(np.count_nonzero(LENGTHS > SEQ + 1))
    with pytest.raises(ValueError, match=f"{expected} of 297 documents are longer than the context cap seq_length {SEQ}"):
        SequenceSampler(DOCS, global_batch_size=16, seq_length=SEQ, seed=9, dp_size=4, dp_split=BY_TOKENS)
    sampler = make_sampler()
    assert expected > 0 and sampler.num_truncated == expected
    for batch in take(sampler, 20):
        assert batch.seq_lengths.max() <= SEQ
        for pos, seq in zip(batch.positions(), batch.sequences()):
            doc = DOCS[seq.doc_index]
            n = min(len(doc), SEQ + 1) - 1
            assert n == batch.seq_lengths[pos] and len(seq.tokens) == n
            assert np.array_equal(seq.tokens, doc[:n]) and np.array_equal(
                seq.labels, doc[1 : n + 1]
            )


def test_no_trainable_documents():
    with pytest.raises(ValueError, match="2 tokens"):
        SequenceSampler(MockDocuments(np.array([0, 1, 1]), 10), 1, SEQ)


def test_rank_sharding_partitions_the_batch():
    batch = take(make_sampler(), 1)[0]
    positions = np.sort(np.concatenate(batch.assignment))
    assert np.array_equal(positions, np.arange(16))
    per_rank = [[s.doc_index for s in batch.sequences(r)] for r in range(4)]
    assert sorted(sum(per_rank, [])) == sorted(batch.doc_indices.tolist())


def test_balance_beats_round_robin_on_skewed_batch():
    lengths = np.array([4000, 3000, 2500, 800, 600, 400, 300, 200, 100, 100, 50, 50])
    ranks = dp_split(lengths, 4, TOKENS)
    greedy_max = max(lengths[r].sum() for r in ranks)
    round_robin_max = max(lengths[r::4].sum() for r in range(4))
    assert greedy_max < round_robin_max
    assert greedy_max == 4000  # the longest sequence alone is the lower bound
    # longest first: a long sequence arriving last must not land on an already loaded rank
    late_long = np.array([1, 1, 1, 1, 4])
    assert [late_long[r].sum() for r in dp_split(late_long, 2, TOKENS)] == [4, 4]
    # by modelled work (here attention's s^2 only) a long sequence weighs more than several short ones
    skewed = np.array([8, 4, 4, 4, 4])
    assert [r.tolist() for r in dp_split(skewed, 2, TOKENS)] == [[0, 3], [1, 2, 4]]
    quadratic = np.eye(6)[0]
    assert [r.tolist() for r in dp_split(skewed, 2, quadratic)] == [[0], [1, 2, 3, 4]]


def test_sampler_deals_the_batch_by_the_given_split():
    lengths = np.array([9, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]) + 1
    docs = MockDocuments(lengths, vocab_size=50, seed=0)
    quadratic = np.eye(6)[0]
    by_tokens = next(SequenceSampler(docs, 16, 64, seed=1, dp_size=2, dp_split=BY_TOKENS).iterate())
    by_work = next(SequenceSampler(docs, 16, 64, seed=1, dp_size=2, dp_split=functools.partial(dp_split, work_vector=quadratic)).iterate())
    assert [a.tolist() for a in by_work.assignment] == [a.tolist() for a in dp_split(by_work.seq_lengths, 2, quadratic)]
    assert [a.tolist() for a in by_tokens.assignment] == [a.tolist() for a in dp_split(by_tokens.seq_lengths, 2, TOKENS)]
    assert [a.tolist() for a in by_work.assignment] != [a.tolist() for a in by_tokens.assignment]


def test_sampler_over_replicas_needs_the_split_and_one_replica_takes_the_batch_in_order():
    with pytest.raises(ValueError, match="dp_size 2: the sampler needs the data-parallel split"):
        SequenceSampler(DOCS, global_batch_size=16, seq_length=SEQ, dp_size=2, truncate=True)
    batch = next(SequenceSampler(DOCS, global_batch_size=16, seq_length=SEQ, seed=9, truncate=True).iterate())
    assert [a.tolist() for a in batch.assignment] == [list(range(16))]


def test_mock_lengths_from_file(tmp_path):
    path = tmp_path / "lengths.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(["1", "10", "100", "100000"]))
    lengths = lengths_from_file(path, num_docs=200, seed=0, scale=0.5, max_length=1000)
    assert set(lengths.tolist()) == {2, 5, 50, 1000}
    assert np.array_equal(
        lengths, lengths_from_file(path, num_docs=200, seed=0, scale=0.5, max_length=1000)
    )
