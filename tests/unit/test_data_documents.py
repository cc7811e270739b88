"""DocumentDataset over an indexed dataset and Megatron split strings."""

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_epp.data.documents import DocumentDataset, split_ranges
from megatron_epp.data.prepare import prepare_dataset
from megatron_epp.data.tokenizers import ByteTokenizer


@pytest.fixture(scope="module")
def dataset_prefix(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("docs")
    for i in range(10):
        (root / f"{i:02d}.txt").write_text("x" * (i + 1))
    prefix = str(root / "ds")
    prepare_dataset([root], prefix, ByteTokenizer(), progress=False)
    return prefix


def test_documents_and_lengths(dataset_prefix):
    docs = DocumentDataset(dataset_prefix)
    assert len(docs) == 10
    assert docs.lengths.tolist() == [i + 2 for i in range(10)]
    assert docs[3].tolist() == [ord("x")] * 4 + [256]
    with pytest.raises(IndexError):
        docs[10]


def test_multi_sequence_documents(tmp_path):
    """Megatron datasets may store a document as several sequences (e.g. sentences)."""
    prefix = str(tmp_path / "multi")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_document(np.array([1, 2, 3, 4, 5]), [2, 3])
    builder.add_document(np.array([6]), [1])
    builder.finalize(prefix + ".idx")
    docs = DocumentDataset(prefix)
    assert docs.lengths.tolist() == [5, 1]
    assert docs[0].tolist() == [1, 2, 3, 4, 5] and docs[1].tolist() == [6]


def test_missing_files_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"indexed dataset not found: .*nothing\.bin/\.idx"):
        DocumentDataset(str(tmp_path / "nothing"))


def test_split_ranges_follow_megatron_semantics():
    assert split_ranges(1000, "969,30,1") == {
        "train": range(0, 969),
        "valid": range(969, 999),
        "test": range(999, 1000),
    }
    # weights are normalised and missing ones are zero
    ranges = split_ranges(10, "3,1")
    assert ranges["train"] == range(0, 8) and ranges["valid"] == range(8, 10)
    assert len(ranges["test"]) == 0


def test_split_views_partition_the_documents(dataset_prefix):
    docs = DocumentDataset(dataset_prefix)
    parts = docs.split("6,2,2")
    assert [len(p) for p in parts.values()] == [6, 2, 2]
    joined = [
        parts[name][i] for name in ("train", "valid", "test") for i in range(len(parts[name]))
    ]
    assert all(np.array_equal(a, docs[i]) for i, a in enumerate(joined))
    assert parts["valid"].lengths.tolist() == docs.lengths[6:8].tolist()
    # a view splits further, relative to itself
    assert parts["train"].split("1,1")["valid"].doc_range == range(3, 6)
