"""Byte and tokenizer.json tokenizers and the factory."""

from pathlib import Path

import pytest
import tokenizers
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from megatron_epp.data.tokenizers import ByteTokenizer, HFTokenizer, TokenizerError, build_tokenizer


def write_word_tokenizer(path: Path, special: str = "<|endoftext|>") -> Path:
    """A tiny word-level tokenizer.json with one special token."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, special: 3}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens([special])
    tok.save(str(path))
    return path


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo\n"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.vocab_size == 257 and tok.eod == 256
    assert tok.detokenize(ids + [tok.eod]) == text


def test_hf_tokenizer_finds_known_eod(tmp_path):
    tok = build_tokenizer(str(write_word_tokenizer(tmp_path / "tokenizer.json")))
    assert isinstance(tok, HFTokenizer)
    assert tok.eod == 3 and tok.vocab_size == 4
    assert tok.tokenize("hello world nope") == [1, 2, 0]
    assert tok.detokenize([1, 2]) == "hello world"


def test_hf_tokenizer_eod_flag_and_missing_eod(tmp_path):
    path = write_word_tokenizer(tmp_path / "tokenizer.json", special="<end>")
    assert HFTokenizer(path, eod_token="<end>").eod == 3
    with pytest.raises(TokenizerError, match="no end-of-document token"):
        HFTokenizer(path)


def test_tokenizer_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot parse tokenizer file"):
        build_tokenizer(str(bad))
    with pytest.raises(TokenizerError, match="tokenizer file not found"):
        build_tokenizer(str(tmp_path / "absent.json"))
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
