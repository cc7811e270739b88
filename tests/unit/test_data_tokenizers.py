"""Tokenizers in Megatron's spelling (--tokenizer-type): bytes, a tokenizer.json, GPT-2's BPE files; the
deprecated --tokenizer; one-line errors for missing or bad files. Tiny tokenizers are built here, no downloads."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import pytest
import tokenizers
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from megatron_epp.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    TokenizerError,
    add_tokenizer_arguments,
    build_tokenizer,
    resolve_tokenizer_args,
    tokenizer_from_args,
)

CORPUS = ["hello world, hello tokenizer", "the quick brown fox jumps over the lazy dog", "hello hello world"] * 20


def write_word_tokenizer(path: Path, special: str = "<|endoftext|>") -> Path:
    """A tiny word-level tokenizer.json with one special token."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, special: 3}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens([special])
    tok.save(str(path))
    return path


def train_byte_bpe(directory: Path) -> tuple[str, str, tokenizers.implementations.ByteLevelBPETokenizer]:
    """GPT-2-style byte-level BPE trained in-process on a few lines: its vocab.json and merges.txt."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = bpe.save_model(str(directory))
    return vocab, merges, bpe


def test_byte_tokenizer_round_trip():
    tok = build_tokenizer("ByteTokenizer")
    assert isinstance(tok, ByteTokenizer)
    text = "héllo\n"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.vocab_size == 257 and tok.eod == 256
    assert tok.detokenize(ids + [tok.eod]) == text


def test_hugging_face_tokenizer_file_and_directory(tmp_path):
    path = write_word_tokenizer(tmp_path / "tokenizer.json")
    for model in (str(path), str(tmp_path)):  # the file, or a directory holding tokenizer.json
        tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=model)
        assert isinstance(tok, HFTokenizer)
        assert tok.eod == 3 and tok.vocab_size == 4
        assert tok.tokenize("hello world nope") == [1, 2, 0]
        assert tok.detokenize([1, 2]) == "hello world"


def test_gpt2_bpe_from_vocab_and_merges(tmp_path):
    vocab, merges, reference = train_byte_bpe(tmp_path / "gpt2")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    text = "hello world, the lazy fox"
    ids = tok.tokenize(text)
    assert ids == reference.encode(text).ids  # the same byte-level BPE the files were trained as
    assert len(ids) < len(text.encode())  # merges applied, not bytes
    assert tok.detokenize(ids) == text
    assert tok.eod == reference.token_to_id("<|endoftext|>") and tok.vocab_size == reference.get_vocab_size()


def test_eod_token_flag_and_missing_eod(tmp_path):
    path = write_word_tokenizer(tmp_path / "tokenizer.json", special="<end>")
    assert build_tokenizer("HuggingFaceTokenizer", str(path), eod_token="<end>").eod == 3
    with pytest.raises(TokenizerError, match="no end-of-document token"):
        build_tokenizer("HuggingFaceTokenizer", str(path))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tokenizer_type="HuggingFaceTokenizer"), "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="v.json"), "--tokenizer-type GPT2BPETokenizer needs --merge-file"),
        (dict(tokenizer_type="ByteTokenizer", tokenizer_model="t.json"), "--tokenizer-model does not apply to --tokenizer-type ByteTokenizer"),
        (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="t.json", vocab_file="v.json"),
         "--vocab-file does not apply to --tokenizer-type HuggingFaceTokenizer"),
        (dict(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-type SentencePieceTokenizer is not supported here"),
        (dict(tokenizer_type="Bytes"), "--tokenizer-type Bytes: unknown (supported: ByteTokenizer, HuggingFaceTokenizer, GPT2BPETokenizer, NullTokenizer)"),
        (dict(tokenizer_type="ByteTokenizer", eod_token="</s>"), "--eod-token does not apply"),
    ],
)
def test_bad_flag_combinations(kwargs, message):
    with pytest.raises(TokenizerError) as error:
        build_tokenizer(**kwargs)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_missing_and_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match=f"cannot parse tokenizer file {bad}"):
        build_tokenizer("HuggingFaceTokenizer", str(bad))
    with pytest.raises(TokenizerError, match=f"--tokenizer-model {tmp_path / 'absent.json'}: no such file"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "absent.json"))
    vocab, merges, _ = train_byte_bpe(tmp_path / "gpt2")
    with pytest.raises(TokenizerError, match="--merge-file nope.txt: no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file="nope.txt")
    Path(merges).write_text("#version: 0.2\nnot-a-token-pair-line\n")
    with pytest.raises(TokenizerError, match="cannot read GPT-2 BPE files") as error:
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert "\n" not in str(error.value)


def test_directory_without_tokenizer_json_needs_transformers(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails, as when it is not installed
    with pytest.raises(TokenizerError, match="no tokenizer.json in the directory, and transformers .* is not installed"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))

    class FakeAuto:  # what transformers.AutoTokenizer.from_pretrained returns, reduced to what is used
        eos_token_id, unk_token_id = 5, 0

        def __len__(self):
            return 7

        def encode(self, text, add_special_tokens):
            assert not add_special_tokens
            return [1, 2]

    calls = []

    def from_pretrained(path, local_files_only):
        calls.append((path, local_files_only))
        return FakeAuto()

    fake = types.SimpleNamespace(AutoTokenizer=types.SimpleNamespace(from_pretrained=from_pretrained))
    monkeypatch.setitem(sys.modules, "transformers", fake)
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert calls == [(str(tmp_path), True)]  # local files only: never a download
    assert (tok.vocab_size, tok.eod, tok.tokenize("x")) == (7, 5, [1, 2])


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_tokenizer_arguments(p)
    return p.parse_args(argv)


def test_deprecated_tokenizer_flag_maps_to_the_new_spelling(tmp_path, capsys):
    args = parse("--tokenizer", "byte")
    vars(args).update(resolve_tokenizer_args(args, "prog"))
    assert args.tokenizer_type == "ByteTokenizer"
    assert capsys.readouterr().err == "prog: warning: --tokenizer byte is deprecated; use --tokenizer-type ByteTokenizer\n"
    path = write_word_tokenizer(tmp_path / "tokenizer.json")
    args = parse("--tokenizer", str(path))
    vars(args).update(resolve_tokenizer_args(args, "prog"))
    assert (args.tokenizer_type, args.tokenizer_model) == ("HuggingFaceTokenizer", str(path))
    assert capsys.readouterr().err.strip().endswith(f"use --tokenizer-type HuggingFaceTokenizer --tokenizer-model {path}")
    assert tokenizer_from_args(args).vocab_size == 4
    args = parse()
    assert resolve_tokenizer_args(args, "prog") == {"tokenizer_type": "ByteTokenizer"}
    assert args.tokenizer_type is None and capsys.readouterr().err == ""  # the default, no warning
    with pytest.raises(TokenizerError, match="deprecated spelling"):
        resolve_tokenizer_args(parse("--tokenizer", "byte", "--tokenizer-type", "ByteTokenizer"), "prog")
