"""Bad flags fail fast with one line on stderr and a non-zero exit, before any process group work.

These cases run pretrain_gpt.py's entry point in this process (the ``pretrain_in_process`` fixture of
tests/conftest.py: the same code, no process start per case); tests/integration/test_bad_input_process.py runs two as a
process."""

from __future__ import annotations

import re

import pytest

from megatron_epp.config.parser import parse_config
from megatron_epp.model.gpt import model_shape, padded_vocab_size
from tests.corpus import write_corpus

BASE = ["--mock-data", "--num-layers", "4"]


@pytest.mark.parametrize(
    "flags, world_size, message",
    [
        (["--bogus-flag"], 1, "unrecognized arguments: --bogus-flag"),
        (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
        (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "--global-batch-size 6 is not divisible"),
        (["--global-batch-size", "6", "--micro-batch-size", "2"], 4, "data parallel 4"),
        (["--num-layers", "abc"], 1, "invalid int value: 'abc'"),
        (["--epp-plan", "seq1f1b"], 1, "--epp-plan needs --elastic-pp"),
        (["--train-iters", "3", "--lr-warmup-iters", "3"], 1, "--lr-warmup-iters 3 must be smaller than --lr-decay-iters 3"),
        (["--elastic-pp", "--recompute-granularity", "full", "--recompute-method", "uniform"], 1,
         "--recompute-granularity does not apply with --elastic-pp"),
        (["--fp8-format", "hybrid"], 1, "argument --fp8-format: not supported here: fp8 needs Transformer Engine"),
        (["--elastic-pp", "--epp-memory-budget", "0"], 1, "--epp-memory-budget must be positive"),
        (["--elastic-pp", "--seq-length", "2048", "--epp-memory-budget", "0.01"], 1, "cannot be planned"),
        (["--train-iters", "0"], 1, "--train-iters and --log-interval must be >= 1"),
        (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "33"], 2,
         "--sequence-parallel: --seq-length 33 is not divisible by --tensor-model-parallel-size 2"),
        (["--ddp-bucket-size", "100"], 1, "--ddp-bucket-size applies only with --overlap-grad-reduce"),
        (["--overlap-grad-reduce", "--ddp-bucket-size", "0"], 1, "--ddp-bucket-size 0: must be >= 1"),
        (["--elastic-pp", "--virtual-pipeline-model-parallel-size", "2"], 1, "interleaved (virtual) pipeline schedule is not supported"),
        (["--context-parallel-size", "2"], 2, "--context-parallel-size 2 needs --elastic-pp"),
        (["--elastic-pp", "--num-attention-heads", "4", "--hidden-size", "64", "--context-parallel-size", "3"], 3,
         "--context-parallel-size 3 does not divide the 4 attention heads per tensor-parallel rank"),
        (["--elastic-pp", "--num-attention-heads", "4", "--hidden-size", "64", "--tensor-model-parallel-size", "2",
          "--context-parallel-size", "4"], 8, "--context-parallel-size 4 does not divide the 2 attention heads per tensor-parallel rank"),
        (["--elastic-pp", "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2,
         "world size 2 is not divisible by tp 1 x cp 2 x pp 2"),
        (["--elastic-pp", "--context-parallel-size", "2", "--cp-comm-type", "p2p"], 2, "--cp-comm-type p2p: not implemented here"),
        (["--elastic-pp", "--context-parallel-size", "0"], 1, "--context-parallel-size 0: must be >= 1"),
        (["--epp-truncate-documents"], 1, "--epp-truncate-documents needs --elastic-pp"),
        (["--elastic-pp", "--epp-calibrate-interval", "-1"], 1, "--epp-calibrate-interval -1: must be >= 0 (0 turns calibration off)"),
        (["--elastic-pp", "--epp-calibrate-interval", "often"], 1, "argument --epp-calibrate-interval: invalid int value: 'often'"),
        (["--epp-calibrate-interval", "5"], 1, "--epp-calibrate-interval needs --elastic-pp"),
        (["--epp-plan-between-steps"], 1, "--epp-plan-between-steps needs --elastic-pp"),
        (["--make-vocab-size-divisible-by", "0"], 1, "--make-vocab-size-divisible-by 0: must be >= 1"),
    ],
)
def test_bad_flags_give_one_line_error(pretrain_in_process, flags, world_size, message):
    proc = pretrain_in_process(*BASE, *flags, world_size=world_size)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert proc.stdout == ""  # stopped before the model and the process group (their lines go to stdout)


@pytest.mark.parametrize("flags, world_size, padded", [
    ([], 1, 384), (["--tensor-model-parallel-size", "2"], 2, 512), (["--make-vocab-size-divisible-by", "1"], 1, 257),
    (["--vocab-size", "1000", "--make-vocab-size-divisible-by", "8", "--tensor-model-parallel-size", "4"], 4, 1024),
])
def test_vocabulary_is_padded_as_megatron_pads_it(flags, world_size, padded):
    args = parse_config([*BASE, *flags], world_size=world_size)
    assert padded_vocab_size(args) == model_shape(args).vocab == padded


def test_help_lists_the_calibration_flag(pretrain_in_process):
    proc = pretrain_in_process("--help")
    assert proc.returncode == 0
    block = proc.stdout.split("\n  --epp-calibrate-interval N")[-1]  # its help, after the usage line
    entry = " ".join(re.split(r"\n\s*\n|\n  -", block)[0].split())  # up to the next flag or group; argparse wraps it
    assert "0: off" in entry and "(default 20)" in entry, entry


def test_mock_and_data_path_are_exclusive(pretrain_in_process, tmp_path):
    proc = pretrain_in_process(*BASE, "--data-path", str(tmp_path / "x"))
    assert proc.returncode == 2 and "exactly one of --mock-data and --data-path" in proc.stderr


def test_tokenizer_file_that_does_not_parse(pretrain_in_process, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    proc = pretrain_in_process(*BASE, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(bad))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt.py: error: cannot parse tokenizer file {bad}: "), proc.stderr
    # the deprecated spelling says so on its own line, then fails the same way
    proc = pretrain_in_process(*BASE, "--tokenizer", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"pretrain_gpt.py: warning: --tokenizer {bad} is deprecated; use --tokenizer-type HuggingFaceTokenizer --tokenizer-model {bad}",
        lines[0],
    ]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/nonexistent/tok.json"],
         "--tokenizer-model /nonexistent/tok.json: no such file"),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nonexistent/vocab.json", "--merge-file", "/nonexistent/m.txt"],
         "--vocab-file /nonexistent/vocab.json: no such file"),
        (["--tokenizer-type", "SentencePieceTokenizer"], "--tokenizer-type SentencePieceTokenizer is not supported here"),
        (["--tokenizer", "byte", "--tokenizer-type", "ByteTokenizer"], "deprecated spelling"),
    ],
)
def test_tokenizer_flags(pretrain_in_process, flags, message):
    proc = pretrain_in_process(*BASE, *flags)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.parametrize("elastic", [[], ["--elastic-pp"]])
def test_train_split_without_documents(pretrain_in_process, tmp_path, elastic):
    prefix = write_corpus(tmp_path / "corpus", ["some text"] * 3)
    proc = pretrain_in_process("--num-layers", "4", "--data-path", prefix, "--split", "0,1,0", *elastic)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no document to train on (3 documents in the corpus, 0 in the train split" in lines[0], proc.stderr


def test_corpus_smaller_than_one_sample(pretrain_in_process, tmp_path):
    prefix = write_corpus(tmp_path / "corpus", ["x"] * 3)
    proc = pretrain_in_process("--num-layers", "4", "--data-path", prefix, "--split", "1,0,0")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "the train split holds 6 tokens, fewer than one sample of --seq-length 128" in lines[0], proc.stderr


def test_document_longer_than_context_cap_needs_truncate_flag(pretrain_in_process, tmp_path):
    prefix = write_corpus(tmp_path / "corpus", ["a" * 50, "b" * 300, "c" * 400] * 10)
    proc = pretrain_in_process("--num-layers", "4", "--data-path", prefix, "--split", "1,0,0", "--elastic-pp", "--seq-length", "128")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "20 of 30 train documents are longer than the context cap --seq-length 128 (longest 400" in lines[0]
    assert "--epp-truncate-documents" in lines[0]
