"""Checks of the training corpus before any process group or model exists.

They read only the indexed dataset's ``.idx`` (document lengths), so they cost milliseconds even for
large corpora, and turn what would fail deep inside a run into one line on stderr.
"""

from __future__ import annotations


import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_epp.data.documents import DocumentDataset, IndexMismatch, loss_mask_prefix, split_ranges
from megatron_epp.data.length_stats import LengthStats
from megatron_epp.config.errors import ArgumentError
from megatron_epp.config.fields import TrainingConfig

MIN_DOCUMENT_TOKENS = 2  # a document of n + 1 tokens trains n next-token predictions


def check_corpus(cfg: TrainingConfig) -> tuple[str, str | None]:
    """Validate ``--data-path`` (each dataset of a blend) for this run; return a one-line summary of the train
    split for the log, and a warning when ``--eval-interval`` has no validation split to evaluate on (``--split``
    gives it no document, or with ``--mock-data`` no share): the run trains without evaluation, as Megatron-LM's.

    Errors, per dataset: its train split holds no trainable document (a blended dataset must be able to give its
    share); without ``--elastic-pp``, a split in use (train; valid with ``--eval-interval`` when some dataset has
    valid documents) with fewer tokens than one ``--seq-length`` sample; with it, a train (or, with
    ``--eval-interval``, valid) document longer than the context cap ``--seq-length`` unless
    ``--epp-truncate-documents`` allows it; a blended dataset with no valid document while another has some; with
    ``--sft``, a dataset without its loss masks or with masks that do not align with its documents.
    """
    if cfg.data.mock_data:  # endless mock streams: --split says which of them exist, as megatron-core's mock datasets
        shares = parse_and_normalize_split(cfg.data.split)
        if not shares[0]:
            raise ArgumentError(f"--mock-data --split {cfg.data.split}: the train share is 0, nothing to train on")
        return "mock documents", no_validation_note(cfg) if cfg.logging.eval_interval and not shares[1] else None

    blend = cfg.data.data_blend
    per_prefix = {}
    for prefix in blend.prefixes:
        try:
            docs = DocumentDataset(prefix, loss_masks=cfg.data.sft)
        except IndexMismatch as error:
            raise ArgumentError(f"--data-path {prefix}: {error}") from None
        splits = {name: docs.lengths[r.start:r.stop] for name, r in split_ranges(len(docs), cfg.data.split).items()}
        if not np.count_nonzero(splits["train"] >= MIN_DOCUMENT_TOKENS):
            raise ArgumentError(
                f"--data-path {prefix}: no document to train on ({len(docs)} documents in the corpus, "
                f"{len(splits['train'])} in the train split of --split {cfg.data.split}, none with {MIN_DOCUMENT_TOKENS}+ tokens)"
            )
        per_prefix[prefix] = splits
    used = ["train"]
    valid = any(len(splits["valid"]) for splits in per_prefix.values())
    if cfg.logging.eval_interval and valid:
        used.append("valid")
        empty = [p for p, splits in per_prefix.items() if not np.count_nonzero(splits["valid"] >= MIN_DOCUMENT_TOKENS)]
        if empty:
            raise ArgumentError(
                f"--data-path {empty[0]}: no validation document under --split {cfg.data.split} while other datasets of the "
                "blend have some; give it a valid share or drop --eval-interval"
            )
    for prefix, splits in per_prefix.items():
        for split in used:
            if not cfg.epp.enabled and splits[split].sum() < cfg.model.seq_length + 1:
                raise ArgumentError(
                    f"--data-path {prefix}: the {split} split holds {int(splits[split].sum())} tokens, fewer than one "
                    f"sample of --seq-length {cfg.model.seq_length} + 1"
                )
            too_long = int(np.count_nonzero(splits[split] - 1 > cfg.model.seq_length))
            if cfg.epp.enabled and too_long and not cfg.epp.truncate_documents:
                raise ArgumentError(
                    f"--data-path {prefix}: {too_long} of {len(splits[split])} {split} documents are longer "
                    f"than the context cap --seq-length {cfg.model.seq_length} (longest {int(splits[split].max()) - 1} "
                    "tokens); raise --seq-length or pass --epp-truncate-documents to train on their first "
                    "--seq-length tokens"
                )
    lengths = np.concatenate([splits["train"] for splits in per_prefix.values()])
    sequences = lengths[lengths >= MIN_DOCUMENT_TOKENS] - 1
    summary = (f"{blend.describe()}; " if blend.weights is not None else "") + f"train split: {LengthStats.of(sequences)}"
    if len(sequences) < len(lengths):
        summary += f"; {len(lengths) - len(sequences)} empty documents skipped"
    too_long = int(np.count_nonzero(sequences > cfg.model.seq_length))
    if cfg.epp.enabled and too_long:
        summary += f"; {too_long} truncated to --seq-length {cfg.model.seq_length}" + (" (and their loss masks)" if cfg.data.sft else "")
    if cfg.data.sft:
        summary += "; --sft: the loss on the assistant's tokens (the loss masks)"
    elif any(IndexedDataset.exists(loss_mask_prefix(p)) for p in blend.prefixes):
        summary += "; loss masks beside the data (conversations) not used: every token trains (--sft: the assistant's only)"
    return summary, no_validation_note(cfg) if cfg.logging.eval_interval and not valid else None


def no_validation_note(cfg: TrainingConfig) -> str:
    return f"--eval-interval {cfg.logging.eval_interval}: the validation split of --split {cfg.data.split} is empty; training without evaluation"
