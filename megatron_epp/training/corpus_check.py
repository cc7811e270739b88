"""Checks of the training corpus before any process group or model exists.

They read only the indexed dataset's ``.idx`` (document lengths), so they cost milliseconds even for
large corpora, and turn what would fail deep inside a run into one line on stderr.
"""

from __future__ import annotations

import argparse

import numpy as np

from megatron_epp.data.documents import DocumentDataset, IndexMismatch, split_ranges
from megatron_epp.data.length_stats import LengthStats
from megatron_epp.training.arguments import ArgumentError

MIN_DOCUMENT_TOKENS = 2  # a document of n + 1 tokens trains n next-token predictions


def check_corpus(args: argparse.Namespace) -> str:
    """Validate ``--data-path`` for this run; return a one-line summary of the train split for the log.

    Errors: the train split holds no trainable document; without ``--elastic-pp``, fewer tokens than
    one ``--seq-length`` sample; with it, a train (or, with ``--eval-interval``, valid) document
    longer than the context cap ``--seq-length`` unless ``--epp-truncate-documents`` allows it.
    """
    if args.mock_data:
        return "mock documents"

    try:
        docs = DocumentDataset(args.data_path)
    except IndexMismatch as error:
        raise ArgumentError(f"--data-path {args.data_path}: {error}") from None
    splits = {name: docs.lengths[r.start:r.stop] for name, r in split_ranges(len(docs), args.split).items()}
    lengths = splits["train"]
    sequences = lengths[lengths >= MIN_DOCUMENT_TOKENS] - 1
    if not len(sequences):
        raise ArgumentError(
            f"--data-path {args.data_path}: no document to train on ({len(docs)} documents in the corpus, "
            f"{len(lengths)} in the train split of --split {args.split}, none with {MIN_DOCUMENT_TOKENS}+ tokens)"
        )
    summary = f"train split: {LengthStats.of(sequences)}"
    if len(sequences) < len(lengths):
        summary += f"; {len(lengths) - len(sequences)} empty documents skipped"
    if not args.elastic_pp:
        if lengths.sum() < args.seq_length + 1:
            raise ArgumentError(
                f"--data-path {args.data_path}: the train split holds {int(lengths.sum())} tokens, fewer than one "
                f"sample of --seq-length {args.seq_length} + 1"
            )
        return summary
    for split in ("train", "valid") if args.eval_interval else ("train",):
        too_long = int(np.count_nonzero(splits[split] - 1 > args.seq_length))
        if too_long and not args.epp_truncate_documents:
            raise ArgumentError(
                f"--data-path {args.data_path}: {too_long} of {len(splits[split])} {split} documents are longer "
                f"than the context cap --seq-length {args.seq_length} (longest {int(splits[split].max()) - 1} "
                "tokens); raise --seq-length or pass --epp-truncate-documents to train on their first "
                "--seq-length tokens"
            )
    too_long = int(np.count_nonzero(sequences > args.seq_length))
    return summary + (f"; {too_long} truncated to --seq-length {args.seq_length}" if too_long else "")
