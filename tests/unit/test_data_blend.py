"""Blended --data-path (Megatron's 0.3 A 0.7 B): parsing, megatron-core's blending indices made endless, whole
documents by weight for --elastic-pp (deterministic, resumable), fixed-length samples by weight for the stock path."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from megatron.core.datasets import helpers

from megatron_epp.data.blend import BlendedDocuments, BlendedSamples, BlendIndex, blended_documents
from megatron_epp.data.data_path import Blend, BlendError
from megatron_epp.data.documents import DocumentDataset
from megatron_epp.data.gpt_samples import GPTSamples
from megatron_epp.data.mock_documents import MockDocuments, lognormal_lengths
from megatron_epp.data.sequence_sampler import SequenceSampler
from megatron_epp.planner.data_parallel import TOKENS, dp_split
from tests.corpus import write_corpus


def test_parse_single_prefix_and_weighted_pairs():
    assert Blend.parse(["data/a"]) == Blend(("data/a",), None)
    blend = Blend.parse(["30", "data/a", "70", "data/b"])
    assert blend.prefixes == ("data/a", "data/b") and blend.weights == pytest.approx((0.3, 0.7))
    assert Blend.parse(["1", "data/a"]) == Blend(("data/a",), (1.0,))  # Megatron's blend of one
    assert blend.describe() == "blend of 0.3 data/a, 0.7 data/b"


@pytest.mark.parametrize(
    "tokens, message",
    [
        (["0.3", "A", "0.7"], "3 values; expected WEIGHT PREFIX pairs"),
        (["-0.3", "A", "1.3", "B"], "weight -0.3 of A must be a positive number"),
        (["0", "A", "1", "B"], "weight 0 of A must be a positive number"),
        (["nan", "A", "1", "B"], "weight nan of A must be a positive number"),
        (["A", "0.3", "B", "0.7"], "expected WEIGHT PREFIX pairs, got 'A' '0.3'"),
        (["0.5", "0.5", "A", "B"], "expected WEIGHT PREFIX pairs, got '0.5' '0.5'"),
        (["A", "B"], "2 prefixes without weights; give a weight before each prefix"),
        (["0.5", "A", "0.5", "A"], "a prefix appears twice"),
        (["0.5"], "1 values; expected WEIGHT PREFIX pairs"),
    ],
)
def test_bad_blends_are_one_line_errors(tokens, message):
    with pytest.raises(BlendError) as error:
        Blend.parse(tokens)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_blend_index_is_megatron_cores_repeated_without_gaps():
    weights = [0.2, 0.5, 0.3]
    reference_ids = np.zeros(1000, dtype=np.int16)
    reference_draws = np.zeros(1000, dtype=np.int64)
    helpers.build_blending_indices(reference_ids, reference_draws, np.array(weights), 3, 1000, False)
    big = BlendIndex(weights)
    ids, draws = big.locate(0, 1000)
    assert np.array_equal(ids, reference_ids) and np.array_equal(draws, reference_draws)

    index = BlendIndex(weights, block=97)  # a block that does not divide evenly: crossings are exercised
    ids, draws = index.locate(0, 5000)
    for d in range(3):  # every dataset's draws are 0, 1, 2, ... in stream order: none skipped, none repeated
        assert np.array_equal(draws[ids == d], np.arange(np.count_nonzero(ids == d)))
    assert np.array_equal(index.counts(5000), np.bincount(ids, minlength=3))
    assert np.abs(index.counts(5000) - 5000 * np.array(weights)).max() <= 5000 / 97 + 1  # within 1 draw per block
    tail_ids, tail_draws = index.locate(1234, 2000)  # any window equals the same window of the whole stream
    assert np.array_equal(tail_ids, ids[1234:3234]) and np.array_equal(tail_draws, draws[1234:3234])


def two_sources():
    a = MockDocuments(lognormal_lengths(50, median=40, sigma=0.8, max_length=200, seed=0), vocab_size=50, seed=1)
    lengths_b = lognormal_lengths(120, median=80, sigma=0.8, max_length=200, seed=2)
    lengths_b[[5, 9]] = [1, 0]  # cannot train: skipped
    return a, MockDocuments(lengths_b, vocab_size=50, seed=3)


def blended_sampler(seed=9, weights=(0.3, 0.7)) -> tuple[SequenceSampler, BlendedDocuments]:
    docs = BlendedDocuments(two_sources(), weights)
    return SequenceSampler(docs, global_batch_size=10, seq_length=256, seed=seed, dp_size=2,
                           dp_split=functools.partial(dp_split, work_vector=TOKENS)), docs


def test_elastic_blend_draws_whole_documents_by_weight():
    sampler, docs = blended_sampler()
    a, b = docs.sources
    batches = list(itertools.islice(sampler.iterate(0), 60))
    stream = np.concatenate([x.doc_indices for x in batches])
    from_a = stream < len(a)
    assert abs(from_a.sum() - 0.3 * len(stream)) <= 1  # megatron-core's greedy blend: within one draw
    # each dataset's documents come epoch by epoch (a permutation of its trainable ones), here 3.6 epochs of A
    a_draws = stream[from_a]
    assert np.array_equal(np.sort(a_draws[:50]), np.arange(50)) and np.array_equal(np.sort(a_draws[50:100]), np.arange(50))
    b_draws = stream[~from_a] - len(a)
    trainable_b = np.flatnonzero(b.lengths >= 2)
    assert np.array_equal(np.sort(b_draws[:118]), trainable_b) and sampler.num_skipped == 2
    # whole documents: the tokens trained are the source document's
    seq = batches[3].sequences()[0]
    index = int(batches[3].doc_indices[0])
    source, local = (a, index) if index < len(a) else (b, index - len(a))
    assert np.array_equal(np.append(seq.tokens, seq.labels[-1]), source[local])


def test_elastic_blend_is_deterministic_and_resumes_exactly():
    full = list(itertools.islice(blended_sampler()[0].iterate(0), 40))
    again = list(itertools.islice(blended_sampler()[0].iterate(0), 40))
    other_seed = list(itertools.islice(blended_sampler(seed=10)[0].iterate(0), 40))
    assert all(np.array_equal(x.doc_indices, y.doc_indices) for x, y in zip(full, again))
    assert not all(np.array_equal(x.doc_indices, y.doc_indices) for x, y in zip(full, other_seed))
    # a run resumed from a checkpoint's consumed_samples continues the stream exactly (epochs crossed on both sides)
    resumed = list(itertools.islice(blended_sampler()[0].iterate(full[17].consumed_samples), 23))
    for x, y in zip(full[17:], resumed):
        assert x.consumed_samples == y.consumed_samples
        assert np.array_equal(x.doc_indices, y.doc_indices) and np.array_equal(x.seq_lengths, y.seq_lengths)
        assert all(np.array_equal(r, s) for r, s in zip(x.assignment, y.assignment))


def test_weights_change_the_mix():
    sampler, docs = blended_sampler(weights=(0.8, 0.2))
    stream = np.concatenate([x.doc_indices for x in itertools.islice(sampler.iterate(0), 50)])
    assert abs((stream < len(docs.sources[0])).sum() - 0.8 * len(stream)) <= 1


def test_stock_blend_draws_fixed_length_samples_by_weight(tmp_path):
    a = write_corpus(tmp_path / "a", ["a" * n for n in range(30, 90)])
    b = write_corpus(tmp_path / "b", ["b" * n for n in range(40, 100)])
    blend = Blend.parse(["0.25", a, "0.75", b])
    sources = [DocumentDataset(p) for p in blend.prefixes]
    samples = BlendedSamples(lambda d, n: GPTSamples(sources[d], 32, seed=5, num_samples=n), blend.weights, 400)
    # a sample is all one dataset's: a's bytes are 97, b's 98 (besides end-of-document ids 256)
    letters = [set(samples[i]["tokens"].tolist()) - {256} for i in range(len(samples))]
    assert all(len(x) == 1 for x in letters) and sum(x == {97} for x in letters) == 100
    for i in (0, 7, 399):
        (d,), (draw,) = samples.index.locate(i, 1)
        expected = GPTSamples(sources[d], 32, seed=5, num_samples=samples.datasets[d].num_samples)[int(draw)]
        assert all(np.array_equal(samples[i][k], expected[k]) for k in expected)
    assert [len(s) for s in samples.datasets] == [100, 300]
    with pytest.raises(IndexError):
        samples[400]
    docs = blended_documents(blend, "1,0,0", "train")
    assert isinstance(docs, BlendedDocuments) and len(docs) == 120 and docs.weights == blend.weights
    assert blended_documents(blend, "1,0,0", "valid") is None


@pytest.mark.parametrize(
    "data_path, message",
    [
        (["0.3", "{a}", "0.7"], "3 values; expected WEIGHT PREFIX pairs"),
        (["-1", "{a}", "2", "{b}"], "weight -1 of {a} must be a positive number"),
        (["0.3", "{a}", "0.7", "{missing}"], "--data-path {missing}: missing {missing}.bin, {missing}.idx"),
        (["0.3", "{a}", "0.7", "{b}"], "--data-path {b}: the train split holds 6 tokens, fewer than one sample of --seq-length 128"),
    ],
)
def test_driver_rejects_bad_blends_before_work(pretrain_in_process, tmp_path, data_path, message):
    names = {"a": write_corpus(tmp_path / "a", ["some text"] * 30), "b": write_corpus(tmp_path / "b", ["x"] * 3),
             "missing": str(tmp_path / "missing")}
    proc = pretrain_in_process("--num-layers", "4", "--split", "1,0,0", "--data-path", *(t.format(**names) for t in data_path))
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message.format(**names) in lines[0], proc.stderr
