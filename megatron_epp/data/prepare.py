"""Text files, directories or JSONL -> Megatron indexed dataset (``PREFIX.bin``/``PREFIX.idx``).

One input document becomes one dataset entry (a single sequence) with the end-of-document token
appended. Documents that are empty or whitespace-only are skipped and counted.

Command line (``python -m megatron_epp.data.prepare``, or ``epp-prepare-data`` once installed)::

    python -m megatron_epp.data.prepare --input corpus/ --pattern '*.md' --output-prefix data/corpus \
        --tokenizer-type ByteTokenizer
    python -m megatron_epp.data.prepare --input train.jsonl --json-keys text \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json --output-prefix data/train --workers 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

with warnings.catch_warnings():  # megatron-core's import warns about optional CUDA extensions, irrelevant here
    warnings.filterwarnings("ignore", message="(Transformer Engine and )?Apex (is|are) not installed")
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

from megatron_epp.data.length_stats import LengthStats
from megatron_epp.data.tokenizers import (
    Tokenizer,
    TokenizerError,
    add_tokenizer_arguments,
    resolve_tokenizer_args,
    tokenizer_from_args,
)

PROG = "epp-prepare-data"  # its errors' name, however it is run (as epp-plan's)
JSONL_SUFFIXES = (".jsonl", ".json")


class DataError(ValueError):
    """Bad input to the data layer; the message is one line meant for the user."""


@dataclass(frozen=True)
class PrepareResult:
    """What ``prepare_dataset`` wrote and how fast."""

    prefix: str
    lengths: np.ndarray  # tokens per written document, end-of-document token included
    num_empty: int
    seconds: float

    @property
    def stats(self) -> LengthStats:
        return LengthStats.of(self.lengths)

    def summary(self) -> str:
        s = self.stats
        secs = max(self.seconds, 1e-9)
        return (
            f"wrote {self.prefix}.bin/.idx: {s}; skipped {self.num_empty} empty documents; "
            f"{s.count / secs:,.0f} docs/s, {s.total / secs:,.0f} tokens/s ({self.seconds:.1f} s)"
        )


def list_input_files(inputs: Sequence[str | Path], pattern: str = "*.txt") -> list[Path]:
    """Files named in ``inputs``; a directory contributes its files matching ``pattern``
    (recursively, sorted)."""
    files: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            files.extend(sorted(p for p in item.rglob(pattern) if p.is_file()))
        elif item.is_file():
            files.append(item)
        else:
            raise DataError(f"input not found: {item}")
    return files


def read_documents(files: Iterable[Path], json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """One document per plain-text file, or per line of a ``.jsonl``/``.json`` file (the values of
    ``json_keys`` joined by newlines)."""
    for path in files:
        if path.suffix not in JSONL_SUFFIXES:
            yield path.read_text(encoding="utf-8", errors="replace")
            continue
        with path.open(encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    yield "\n".join(str(record[k]) for k in json_keys)
                except json.JSONDecodeError:
                    raise DataError(f"{path}:{lineno}: not a JSON line") from None
                except (KeyError, TypeError):
                    raise DataError(f"{path}:{lineno}: no key(s) {list(json_keys)}") from None


def encode_document(tokenizer: Tokenizer, text: str) -> np.ndarray | None:
    """Token ids of ``text`` followed by the end-of-document id; None for an empty document."""
    if not text.strip():
        return None
    ids = tokenizer.tokenize(text)
    ids.append(tokenizer.eod)
    return np.asarray(ids, dtype=DType.optimal_dtype(tokenizer.vocab_size))


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_in_worker(text: str) -> np.ndarray | None:
    return encode_document(_worker_tokenizer, text)


def _encode_all(
    tokenizer: Tokenizer, texts: Iterable[str], workers: int
) -> Iterator[np.ndarray | None]:
    """``encode_document`` over ``texts`` in order, in ``workers`` processes when more than one."""
    if workers <= 1:
        yield from (encode_document(tokenizer, t) for t in texts)
        return
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        yield from pool.imap(_encode_in_worker, texts, chunksize=16)


class _Progress:
    """A one-line progress counter on stderr, redrawn at most twice a second."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = self.last = time.perf_counter()

    def update(self, docs: int, tokens: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.5 and not force):
            return
        self.last = now
        secs = max(now - self.start, 1e-9)
        print(
            f"\r[prepare] {docs:,} docs, {tokens:,} tokens, {docs / secs:,.0f} docs/s, "
            f"{tokens / secs:,.0f} tokens/s",
            end="\n" if force else "",
            file=sys.stderr,
            flush=True,
        )


def prepare_dataset(
    inputs: Sequence[str | Path],
    output_prefix: str | Path,
    tokenizer: Tokenizer,
    json_keys: Sequence[str] = ("text",),
    pattern: str = "*.txt",
    workers: int = 1,
    progress: bool = True,
) -> PrepareResult:
    """Tokenize ``inputs`` into the indexed dataset ``output_prefix``; see the module docstring."""
    files = list_input_files(inputs, pattern)
    if not files:
        raise DataError(f"no input files in {[str(i) for i in inputs]} matching {pattern!r}")
    prefix = str(output_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    bar = _Progress(progress)
    lengths: list[int] = []
    num_empty = total_tokens = 0
    builder = IndexedDatasetBuilder(
        get_bin_path(prefix), dtype=DType.optimal_dtype(tokenizer.vocab_size)
    )
    try:
        for ids in _encode_all(tokenizer, read_documents(files, json_keys), workers):
            if ids is None:
                num_empty += 1
                continue
            builder.add_document(ids, [ids.size])
            lengths.append(ids.size)
            total_tokens += ids.size
            bar.update(len(lengths), total_tokens)
        if not lengths:
            raise DataError(f"no documents: all {num_empty} input documents are empty")
        builder.finalize(get_idx_path(prefix))
    except BaseException:
        builder.data_file.close()
        for path in (get_bin_path(prefix), get_idx_path(prefix)):
            Path(path).unlink(missing_ok=True)
        raise
    seconds = time.perf_counter() - bar.start
    bar.update(len(lengths), total_tokens, force=True)
    return PrepareResult(prefix, np.asarray(lengths, dtype=np.int64), num_empty, seconds)


# --------------------------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="text files, directories (recursive) or .jsonl/.json files",
    )
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="JSONL keys whose values (newline-joined) form a document",
    )
    p.add_argument("--pattern", default="*.txt", help="file glob for directory inputs")
    add_tokenizer_arguments(p)
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids 0..N-1, end of document N (as Megatron-LM)")
    p.add_argument("--append-eod", action="store_true",
                   help="accepted for Megatron-LM's preprocess_data.py: every document here ends with the "
                   "tokenizer's end-of-document id, with or without this flag (the elastic planner trains whole documents)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The command line (``python -m megatron_epp.data.prepare``, ``epp-prepare-data``): 0, or 1 with one line on a bad
    input."""
    args = parse_args(argv)
    try:
        vars(args).update(resolve_tokenizer_args(args, PROG))
        tokenizer = tokenizer_from_args(args)
        result = prepare_dataset(
            args.input,
            args.output_prefix,
            tokenizer,
            json_keys=args.json_keys,
            pattern=args.pattern,
            workers=args.workers,
            progress=not args.no_progress,
        )
    except (DataError, TokenizerError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
