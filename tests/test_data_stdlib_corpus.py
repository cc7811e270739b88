"""The embedded stdlib corpus: built from sorted stdlib sources, cached by manifest."""

import numpy as np
import pytest

from megatron_epp.data import stdlib_corpus
from megatron_epp.data.documents import DocumentDataset
from megatron_epp.data.tokenizers import ByteTokenizer


def test_build_then_reuse(tmp_path, monkeypatch, capsys):
    files = stdlib_corpus.stdlib_files(max_files=12)
    assert files == sorted(files) and len(files) == 12
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)

    prefix = stdlib_corpus.ensure_stdlib_corpus(tmp_path, max_files=12, progress=False)
    assert "stdlib corpus built from 12 files" in capsys.readouterr().out
    docs = DocumentDataset(prefix)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    nonempty = [t for t in texts if t.strip()]
    assert len(docs) == len(nonempty)
    assert ByteTokenizer().detokenize(docs[0]) == nonempty[0]
    assert docs[0][-1] == ByteTokenizer().eod

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached corpus must be reused")

    monkeypatch.setattr(stdlib_corpus, "prepare_dataset", no_rebuild)
    assert stdlib_corpus.ensure_stdlib_corpus(tmp_path, max_files=12) == prefix
    assert "(cached)" in capsys.readouterr().out
    # a different file count does not match the manifest: rebuilt
    with pytest.raises(AssertionError, match="must be reused"):
        stdlib_corpus.ensure_stdlib_corpus(tmp_path, max_files=13)


def test_stdlib_lengths_are_skewed(tmp_path):
    docs = DocumentDataset(
        stdlib_corpus.ensure_stdlib_corpus(tmp_path, max_files=60, progress=False)
    )
    assert docs.lengths.max() > 4 * np.median(docs.lengths)
