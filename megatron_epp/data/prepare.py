"""Text files, directories or JSONL -> Megatron indexed dataset (``PREFIX.bin``/``PREFIX.idx``).

One input document becomes one dataset entry (a single sequence) with the end-of-document token
appended. Documents that are empty or whitespace-only are skipped and counted.

With ``--sft`` the input is conversations (JSONL lines ``{"messages": [{"role": ..., "content": ...}, ...]}``), each
rendered with the chat template of ``--tokenizer-model`` (:mod:`~megatron_epp.data.conversations`) into one entry, no
token appended, and the per-token loss masks (1: an assistant token) go to a second indexed dataset beside it,
``PREFIX_loss_mask.bin/.idx`` (uint8, the same document lengths), which ``pretrain_gpt.py --sft`` reads. A line that is
not a conversation, or on which the template fails, is one line naming the file and line (exit 2) and nothing is
written. Either way the files are written under temporary names and renamed at the end: a failed run leaves an older
dataset at ``PREFIX`` as it was.

Command line (``python -m megatron_epp.data.prepare``, or ``epp-prepare-data`` once installed)::

    python -m megatron_epp.data.prepare --input corpus/ --pattern '*.md' --output-prefix data/corpus \
        --tokenizer-type ByteTokenizer
    python -m megatron_epp.data.prepare --input train.jsonl --json-keys text \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json --output-prefix data/train --workers 2
    python -m megatron_epp.data.prepare --sft --input chats.jsonl --output-prefix data/chats \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model qwen2.5-0.5b-instruct/
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

with warnings.catch_warnings():  # megatron-core's import warns about optional CUDA extensions, irrelevant here
    warnings.filterwarnings("ignore", message="(Transformer Engine and )?Apex (is|are) not installed")
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

from megatron_epp.data.conversations import ChatTemplate, ConversationEncoder, ConversationError, check_messages
from megatron_epp.data.documents import loss_mask_prefix
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
    trained_tokens: int | None = None  # --sft: tokens with loss mask 1 (None: no masks written)
    untrained_documents: int = 0  # --sft: conversations without any (no assistant message)

    @property
    def stats(self) -> LengthStats:
        return LengthStats.of(self.lengths)

    def summary(self) -> str:
        s = self.stats
        secs = max(self.seconds, 1e-9)
        if self.trained_tokens is None:
            wrote = f"wrote {self.prefix}.bin/.idx: {s}; skipped {self.num_empty} empty documents"
        else:
            wrote = (f"wrote {self.prefix}.bin/.idx and {loss_mask_prefix(self.prefix)}.bin/.idx: {s}; loss on "
                     f"{self.trained_tokens:,} tokens ({100 * self.trained_tokens / max(s.total, 1):.1f} %: the assistant's), "
                     f"{self.untrained_documents} conversations with none")
        return f"{wrote}; {s.count / secs:,.0f} docs/s, {s.total / secs:,.0f} tokens/s ({self.seconds:.1f} s)"


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


_worker: tuple[Callable[[Any, Any], Any], Any] | None = None  # a pool process's (encode, state)


def _init_worker(encode: Callable[[Any, Any], Any], state: Any) -> None:
    global _worker
    _worker = (encode, state)


def _in_worker(item: Any) -> Any:
    encode, state = _worker
    return encode(state, item)


def _map_encode(encode: Callable[[Any, Any], Any], state: Any, items: Iterable[Any], workers: int) -> Iterator[Any]:
    """``encode(state, item)`` over ``items`` in order, in ``workers`` processes when more than one (``state``, the
    tokenizer or the conversation encoder, sent once to each)."""
    if workers <= 1:
        yield from (encode(state, item) for item in items)
        return
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(encode, state)) as pool:
        yield from pool.imap(_in_worker, items, chunksize=16)


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


def read_conversation_lines(files: Iterable[Path]) -> Iterator[tuple[str, str]]:
    """``("FILE:LINE", text)`` of every non-blank line of ``files`` (JSONL conversations, whatever their suffix)."""
    for path in files:
        with path.open(encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield f"{path}:{lineno}", line


def encode_conversation_line(encoder: ConversationEncoder, where: str, line: str) -> tuple[np.ndarray, np.ndarray]:
    """One JSONL line's conversation as (ids, loss mask); any fault of the line is a :class:`DataError` ``WHERE: ...``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise DataError(f"{where}: not a JSON line") from None
    try:
        encoded = encoder.encode(check_messages(record))
    except ConversationError as error:
        raise DataError(f"{where}: {error}") from None
    return encoded.ids.astype(DType.optimal_dtype(encoder.tokenizer.vocab_size)), encoded.loss_mask


def _encode_conversation_item(encoder: ConversationEncoder, item: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_conversation_line(encoder, *item)


class _Output:
    """An indexed dataset being written under temporary names (``PREFIX.bin.tmp``, ...), renamed to ``PREFIX.bin/.idx``
    by :meth:`finish`, removed by :meth:`discard`."""

    def __init__(self, prefix: str, dtype) -> None:
        self.prefix = prefix
        self.paths = [get_bin_path(prefix), get_idx_path(prefix)]
        self.builder = IndexedDatasetBuilder(self.paths[0] + ".tmp", dtype=dtype)

    def add(self, array: np.ndarray) -> None:
        self.builder.add_document(array, [array.size])

    def finish(self) -> None:
        self.builder.finalize(self.paths[1] + ".tmp")
        for path in self.paths:
            os.replace(path + ".tmp", path)

    def discard(self) -> None:
        self.builder.data_file.close()
        for path in self.paths:
            Path(path + ".tmp").unlink(missing_ok=True)


def _write(prefix: str, encoded: Iterable[tuple[np.ndarray | None, np.ndarray | None]], dtype, masks: bool,
           bar: _Progress) -> tuple[list[int], int, int, int]:
    """The documents of ``encoded`` (``(ids, loss mask)``; ids None: an empty document, skipped) written to ``prefix``, and
    with ``masks`` their loss masks to ``loss_mask_prefix(prefix)``: ``(lengths, empty, trained tokens, documents with no
    trained token)``. Nothing is left at either prefix when it fails."""
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    outputs = [_Output(prefix, dtype)] + ([_Output(loss_mask_prefix(prefix), np.uint8)] if masks else [])
    lengths: list[int] = []
    num_empty = total_tokens = trained = untrained = 0
    try:
        for ids, mask in encoded:
            if ids is None:
                num_empty += 1
                continue
            outputs[0].add(ids)
            if masks:
                outputs[1].add(mask)
                trained += int(mask.sum())
                untrained += not mask.any()
            lengths.append(ids.size)
            total_tokens += ids.size
            bar.update(len(lengths), total_tokens)
        if not lengths:
            raise DataError(f"no documents: all {num_empty} input documents are empty")
        for output in outputs:
            output.finish()
    except BaseException:
        for output in outputs:
            output.discard()
        raise
    return lengths, num_empty, trained, untrained


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
    files = _input_files(inputs, pattern)
    bar = _Progress(progress)
    encoded = ((ids, None) for ids in _map_encode(encode_document, tokenizer, read_documents(files, json_keys), workers))
    lengths, num_empty, _, _ = _write(str(output_prefix), encoded, DType.optimal_dtype(tokenizer.vocab_size), False, bar)
    seconds = time.perf_counter() - bar.start
    bar.update(len(lengths), sum(lengths), force=True)
    return PrepareResult(str(output_prefix), np.asarray(lengths, dtype=np.int64), num_empty, seconds)


def prepare_conversations(
    inputs: Sequence[str | Path],
    output_prefix: str | Path,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    pattern: str = "*.jsonl",
    workers: int = 1,
    progress: bool = True,
) -> PrepareResult:
    """``--sft``: the conversations of ``inputs`` (JSONL) rendered with ``template``, tokenised, into the indexed dataset
    ``output_prefix`` and their loss masks into ``loss_mask_prefix(output_prefix)``; see the module docstring."""
    try:
        encoder = ConversationEncoder(template, tokenizer)
    except ConversationError as error:
        raise DataError(str(error)) from None
    files = _input_files(inputs, pattern)
    bar = _Progress(progress)
    encoded = _map_encode(_encode_conversation_item, encoder, read_conversation_lines(files), workers)
    lengths, _, trained, untrained = _write(str(output_prefix), encoded, DType.optimal_dtype(tokenizer.vocab_size), True, bar)
    seconds = time.perf_counter() - bar.start
    bar.update(len(lengths), sum(lengths), force=True)
    return PrepareResult(str(output_prefix), np.asarray(lengths, dtype=np.int64), 0, seconds, trained, untrained)


def _input_files(inputs: Sequence[str | Path], pattern: str) -> list[Path]:
    files = list_input_files(inputs, pattern)
    if not files:
        raise DataError(f"no input files in {[str(i) for i in inputs]} matching {pattern!r}")
    return files


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
        default=None,
        help="JSONL keys whose values (newline-joined) form a document (default: text)",
    )
    p.add_argument("--pattern", default=None, help="file glob for directory inputs (default *.txt; *.jsonl with --sft)")
    p.add_argument("--sft", action="store_true",
                   help='conversations: JSONL lines {"messages": [{"role": system|user|assistant|tool, "content": ...}]} '
                   "rendered with the chat template of --tokenizer-model (HuggingFaceTokenizer); also writes their loss "
                   "masks (1: the assistant's tokens) as PREFIX_loss_mask.bin/.idx, for pretrain_gpt.py --sft")
    add_tokenizer_arguments(p)
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids 0..N-1, end of document N (as Megatron-LM)")
    p.add_argument("--append-eod", action="store_true",
                   help="accepted for Megatron-LM's preprocess_data.py: every document here ends with the "
                   "tokenizer's end-of-document id, with or without this flag (the elastic planner trains whole documents); "
                   "not with --sft, where a conversation ends with its template's last token")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p.parse_args(argv)


def _prepare(args: argparse.Namespace) -> PrepareResult:
    """What the command line asks for (tokenizer flags resolved); bad input is a :class:`DataError`/:class:`TokenizerError`."""
    tokenizer = tokenizer_from_args(args)
    common = {"workers": args.workers, "progress": not args.no_progress}
    if not args.sft:
        return prepare_dataset(args.input, args.output_prefix, tokenizer, json_keys=args.json_keys or ["text"],
                               pattern=args.pattern or "*.txt", **common)
    if args.json_keys is not None or args.append_eod:
        raise DataError(f"{'--json-keys' if args.json_keys is not None else '--append-eod'} does not apply with --sft "
                        "(a conversation is its messages, rendered by the chat template)")
    if args.tokenizer_type != "HuggingFaceTokenizer":
        raise DataError(f"--sft needs --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (its chat template), "
                        f"not {args.tokenizer_type}")
    try:
        template = ChatTemplate.from_tokenizer(args.tokenizer_model)
    except ConversationError as error:
        raise DataError(str(error)) from None
    return prepare_conversations(args.input, args.output_prefix, tokenizer, template, pattern=args.pattern or "*.jsonl",
                                 **common)


def main(argv: list[str] | None = None) -> int:
    """The command line (``python -m megatron_epp.data.prepare``, ``epp-prepare-data``): 0, or 2 with one line on a bad
    input (nothing written)."""
    args = parse_args(argv)
    try:
        vars(args).update(resolve_tokenizer_args(args, PROG))
        result = _prepare(args)
    except (DataError, TokenizerError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
