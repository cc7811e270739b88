"""Tokenizers in Megatron-LM's spelling (``--tokenizer-type``), shared by ``pretrain_gpt.py`` and
``python -m megatron_epp.data.prepare``:

* ``ByteTokenizer``: UTF-8 bytes as ids 0..255 and an end-of-document id 256; needs no files.
* ``HuggingFaceTokenizer --tokenizer-model PATH``: a Hugging Face ``tokenizer.json`` (the file, or a
  directory holding one), loaded with the ``tokenizers`` package; a directory without one is read by
  ``transformers.AutoTokenizer`` (local files only, never a download) when ``transformers`` imports.
* ``GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt``: GPT-2's byte-level BPE
  (the ``tokenizers`` package's BPE model with byte-level pre-tokenizer and decoder).
* ``NullTokenizer --vocab-size V``: Megatron-LM's: text is space-separated token ids, the
  end-of-document id is ``V`` and the vocabulary ``V + 1``; for mock data and pre-tokenized text.

The end-of-document token of a file-based tokenizer is the first of :data:`KNOWN_EOD_TOKENS` it has
(``--eod-token`` names another). The old ``--tokenizer byte|FILE`` still works, with a deprecation line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Protocol, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from megatron_epp.base.options import add_fields_to_parser, option

# Special tokens tried, in order, as the end-of-document token of a tokenizer file.
KNOWN_EOD_TOKENS: tuple[str, ...] = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")

TOKENIZER_TYPES = ("ByteTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")
# Megatron-LM's other --tokenizer-type values: named in the error, not silently replaced
MEGATRON_ONLY_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                       "Llama2Tokenizer", "TikTokenizer", "MultimodalTokenizer")
# which file flags each type reads; any other given is an error
_FILES = {"ByteTokenizer": (), "HuggingFaceTokenizer": ("tokenizer_model",), "GPT2BPETokenizer": ("vocab_file", "merge_file"),
          "NullTokenizer": ()}


class TokenizerError(ValueError):
    """A tokenizer that cannot be built (bad flags, missing or unparsable file, no end-of-document token)."""


class Tokenizer(Protocol):
    """What the data layer needs from a tokenizer."""

    name: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus an end-of-document id 256; needs no files."""

    name = "ByteTokenizer"

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod(self) -> int:
        return 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode byte ids (special ids dropped, invalid UTF-8 replaced)."""
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


class NullTokenizer:
    """Megatron-LM's ``NullTokenizer``: ``vocab_size`` ids (``--vocab-size``) plus the end-of-document id
    ``vocab_size``; text is the ids written in decimal, separated by spaces."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        self._vocab_without_eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_without_eod + 1

    @property
    def eod(self) -> int:
        return self._vocab_without_eod

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError as error:
            raise TokenizerError(f"NullTokenizer reads space-separated token ids: {error}") from None
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise TokenizerError(f"NullTokenizer: token id {bad} outside the vocabulary 0..{self.vocab_size - 1}")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (``HuggingFaceTokenizer``'s ``tokenizer.json``, or GPT-2's BPE files)
    with its end-of-document token."""

    def __init__(self, tok: tokenizers.Tokenizer, name: str, eod_token: str | None = None) -> None:
        self.name = name
        self._tok = tok
        candidates = (eod_token,) if eod_token else KNOWN_EOD_TOKENS
        eod = next((i for t in candidates if (i := tok.token_to_id(t)) is not None), None)
        if eod is None:
            raise TokenizerError(
                f"tokenizer {name} has no end-of-document token among {list(candidates)}; name one with --eod-token"
            )
        self._eod = eod

    @classmethod
    def from_file(cls, path: str | Path, eod_token: str | None = None) -> "HFTokenizer":
        """A ``tokenizer.json``."""
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust parser raises a bare Exception
            raise TokenizerError(f"cannot parse tokenizer file {path}: {_one_line(exc)}") from None
        return cls(tok, str(path), eod_token)

    @classmethod
    def gpt2_bpe(cls, vocab_file: str, merge_file: str, eod_token: str | None = None) -> "HFTokenizer":
        """GPT-2's byte-level BPE from its ``vocab.json`` and ``merges.txt``."""
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as exc:
            raise TokenizerError(f"cannot read GPT-2 BPE files {vocab_file}, {merge_file}: {_one_line(exc)}") from None
        tok = tokenizers.Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return cls(tok, vocab_file, eod_token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``tokenize``'s ids and each token's character span in ``text`` (what a chat template's loss mask needs)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class AutoTokenizerWrapper:
    """A local Hugging Face tokenizer directory without ``tokenizer.json``, read by
    ``transformers.AutoTokenizer`` (only when ``transformers`` is installed; never downloads)."""

    def __init__(self, directory: str, eod_token: str | None = None) -> None:
        try:
            import transformers  # optional dependency
        except ImportError:
            raise TokenizerError(
                f"--tokenizer-model {directory}: no tokenizer.json in the directory, and transformers (to read its "
                "other formats) is not installed"
            ) from None
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as exc:
            raise TokenizerError(f"--tokenizer-model {directory}: transformers cannot load it: {_one_line(exc)}") from None
        self.name = directory
        eod = self._tok.convert_tokens_to_ids(eod_token) if eod_token else self._tok.eos_token_id
        if eod is None or eod == self._tok.unk_token_id:
            raise TokenizerError(f"tokenizer {directory} has no end-of-document token; name one with --eod-token")
        self._eod = int(eod)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _require_file(flag: str, path: str) -> None:
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} {path}: no such file")


def build_tokenizer(
    tokenizer_type: str = "ByteTokenizer",
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    eod_token: str | None = None,
    vocab_size: int | None = None,
) -> Tokenizer:
    """The tokenizer of Megatron's ``--tokenizer-type`` and its file flags (``vocab_size``: ``NullTokenizer``'s ids
    before its end-of-document id); bad combinations, missing or unparsable files are a :class:`TokenizerError`
    with a one-line message."""
    if tokenizer_type in MEGATRON_ONLY_TYPES:
        raise TokenizerError(
            f"--tokenizer-type {tokenizer_type} is not supported here (supported: {', '.join(TOKENIZER_TYPES)}; "
            "a Hugging Face tokenizer.json of the same vocabulary works with HuggingFaceTokenizer)"
        )
    if tokenizer_type not in TOKENIZER_TYPES:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type}: unknown (supported: {', '.join(TOKENIZER_TYPES)})")
    given = {"tokenizer_model": tokenizer_model, "vocab_file": vocab_file, "merge_file": merge_file}
    for key, value in given.items():
        flag = "--" + key.replace("_", "-")
        if value is not None and key not in _FILES[tokenizer_type]:
            raise TokenizerError(f"{flag} does not apply to --tokenizer-type {tokenizer_type}")
        if value is None and key in _FILES[tokenizer_type]:
            raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if eod_token is not None and tokenizer_type == "ByteTokenizer":
        raise TokenizerError("--eod-token does not apply to --tokenizer-type ByteTokenizer (its end-of-document id is 256)")
    if eod_token is not None and tokenizer_type == "NullTokenizer":
        raise TokenizerError("--eod-token does not apply to --tokenizer-type NullTokenizer (its end-of-document id is --vocab-size)")
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size N (N >= 1: ids 0..N-1, end of document N)")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        _require_file("--vocab-file", vocab_file)
        _require_file("--merge-file", merge_file)
        return HFTokenizer.gpt2_bpe(vocab_file, merge_file, eod_token)
    if os.path.isdir(tokenizer_model):
        inner = os.path.join(tokenizer_model, "tokenizer.json")
        if os.path.isfile(inner):
            return HFTokenizer.from_file(inner, eod_token)
        return AutoTokenizerWrapper(tokenizer_model, eod_token)
    _require_file("--tokenizer-model", tokenizer_model)
    return HFTokenizer.from_file(tokenizer_model, eod_token)


@dataclass(frozen=True)
class TokenizerOptions:
    """The tokenizer flags, for every command line that tokenizes (one spelling across them)."""

    tokenizer_type: str | None = option("--tokenizer-type", metavar="TYPE", help=f"{' | '.join(TOKENIZER_TYPES)} (default ByteTokenizer: UTF-8 bytes, vocabulary 257; NullTokenizer: "
                                        "as Megatron-LM, --vocab-size N ids plus the end-of-document id N, text of space-separated ids)")
    tokenizer_model: str | None = option("--tokenizer-model", metavar="PATH",
                                         help="HuggingFaceTokenizer: a tokenizer.json, or a local directory holding one")
    vocab_file: str | None = option("--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json")
    merge_file: str | None = option("--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt")
    eod_token: str | None = option("--eod-token", help="end-of-document token of a file-based tokenizer (default: the first of "
                                   f"{', '.join(KNOWN_EOD_TOKENS)})")
    tokenizer: str | None = option("--tokenizer", metavar="byte|FILE", help="deprecated: --tokenizer-type ByteTokenizer, or "
                                   "--tokenizer-type HuggingFaceTokenizer --tokenizer-model FILE")


def add_tokenizer_arguments(group) -> None:
    """The tokenizer flags (:class:`TokenizerOptions`) on ``group``, an argparse parser or group."""
    add_fields_to_parser(group, TokenizerOptions)


def resolve_tokenizer_args(args, prog: str) -> dict[str, str | None]:
    """``--tokenizer-type`` (default ``ByteTokenizer``) and the deprecated ``--tokenizer`` mapped onto the new flags
    (one deprecation line on stderr; both spellings at once is an error): the changed values, by dest."""
    if args.tokenizer is not None:
        if args.tokenizer_type is not None or args.tokenizer_model is not None:
            raise TokenizerError("--tokenizer is the deprecated spelling of --tokenizer-type/--tokenizer-model: give one of them")
        if args.tokenizer == "byte":
            changes, new = {"tokenizer_type": "ByteTokenizer"}, "--tokenizer-type ByteTokenizer"
        else:
            changes = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": args.tokenizer}
            new = f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {args.tokenizer}"
        print(f"{prog}: warning: --tokenizer {args.tokenizer} is deprecated; use {new}", file=sys.stderr)
        return {**changes, "tokenizer": None}
    return {"tokenizer_type": "ByteTokenizer"} if args.tokenizer_type is None else {}


def tokenizer_from_args(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer the (resolved) tokenizer flags name."""
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file, args.eod_token,
                           vocab_size=getattr(args, "vocab_size", None))
