"""Tokenizers: a file-free byte-level tokenizer and a Hugging Face ``tokenizer.json`` wrapper."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence

import tokenizers

# Special tokens tried, in order, as the end-of-document token of a tokenizer.json.
KNOWN_EOD_TOKENS: tuple[str, ...] = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be built (unparsable file, no end-of-document token)."""


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

    name = "byte"

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


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package."""

    def __init__(self, path: str | Path, eod_token: str | None = None) -> None:
        self.name = str(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust parser raises a bare Exception
            raise TokenizerError(f"cannot parse tokenizer file {path}: {exc}") from None
        candidates = (eod_token,) if eod_token else KNOWN_EOD_TOKENS
        eod = next((i for t in candidates if (i := self._tok.token_to_id(t)) is not None), None)
        if eod is None:
            raise TokenizerError(
                f"tokenizer {path} has no end-of-document token among {list(candidates)}; "
                "name one with --eod-token"
            )
        self._eod = eod

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def build_tokenizer(name_or_path: str, eod_token: str | None = None) -> Tokenizer:
    """``"byte"`` for the byte tokenizer, otherwise the path of a ``tokenizer.json``."""
    if name_or_path == "byte":
        return ByteTokenizer()
    if not Path(name_or_path).is_file():
        raise TokenizerError(f"tokenizer file not found: {name_or_path} (or use 'byte')")
    return HFTokenizer(name_or_path, eod_token)
