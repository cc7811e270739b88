#!/usr/bin/env python3
"""Tokenize text files, directories or JSONL into a Megatron indexed dataset (PREFIX.bin/.idx).

Example:
    python scripts/prepare_data.py --input corpus/ --pattern '*.md' --output-prefix data/corpus \
        --tokenizer-type ByteTokenizer
    python scripts/prepare_data.py --input train.jsonl --json-keys text \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json --output-prefix data/train --workers 2
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

# megatron-core's import warns about optional CUDA extensions; irrelevant to data preparation.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_epp.data.prepare import DataError, prepare_dataset  # noqa: E402
from megatron_epp.data.tokenizers import (  # noqa: E402
    TokenizerError,
    add_tokenizer_arguments,
    resolve_tokenizer_args,
    tokenizer_from_args,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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
    args = parse_args(argv)
    try:
        vars(args).update(resolve_tokenizer_args(args, "prepare_data.py"))
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
        print(f"prepare_data.py: error: {exc}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
