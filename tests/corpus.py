"""An indexed corpus for a test: documents written as JSONL and prepared as pretrain_gpt.py reads them."""

from __future__ import annotations

import json

from megatron_epp.data.prepare import prepare_dataset
from megatron_epp.data.tokenizers import ByteTokenizer


def write_corpus(prefix, documents: list[str]) -> str:
    """An indexed byte-token dataset of ``documents`` at ``prefix`` (its JSONL beside it, named after it, so corpora
    can share a folder); returns the prefix as --data-path takes it."""
    jsonl = prefix.parent / f"{prefix.name}.jsonl"
    jsonl.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents))
    prepare_dataset([jsonl], prefix, ByteTokenizer(), pattern="*.jsonl", progress=False)
    return str(prefix)
