"""prepare_dataset and its command line (python -m megatron_epp.data.prepare, epp-prepare-data): inputs -> indexed dataset -> documents."""

import json

import numpy as np
import pytest

from megatron_epp.data.documents import DocumentDataset
from megatron_epp.data import prepare as prepare_data
from megatron_epp.data.prepare import DataError, prepare_dataset
from megatron_epp.data.tokenizers import ByteTokenizer, build_tokenizer
from tests.unit.test_data_tokenizers import write_word_tokenizer


BYTE = ByteTokenizer()


def test_directory_round_trip_with_pattern_and_empty_docs(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("second doc")
    (corpus / "sub" / "a.txt").write_text("first")
    (corpus / "empty.txt").write_text("  \n")
    (corpus / "skip.md").write_text("not matched")
    result = prepare_dataset([corpus], tmp_path / "out" / "ds", BYTE, progress=False)
    docs = DocumentDataset(str(tmp_path / "out" / "ds"))
    # sorted recursive order: b.txt, empty.txt (skipped), sub/a.txt
    expected = [b"second doc", b"first"]
    assert len(docs) == 2 and result.num_empty == 1
    for i, text in enumerate(expected):
        assert docs[i].tolist() == list(text) + [BYTE.eod]
        assert docs[i].dtype == np.int64
    assert docs.lengths.tolist() == [len(t) + 1 for t in expected]
    assert result.stats.total == sum(len(t) + 1 for t in expected)
    assert "p99" in result.summary() and "tokens/s" in result.summary()


def test_jsonl_with_several_keys(tmp_path):
    src = tmp_path / "data.jsonl"
    rows = [
        {"title": "T1", "text": "body one"},
        {"title": "T2", "text": ""},
        {"title": "", "text": ""},
    ]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    result = prepare_dataset(
        [src], tmp_path / "ds", BYTE, json_keys=("title", "text"), progress=False
    )
    docs = DocumentDataset(str(tmp_path / "ds"))
    assert [BYTE.detokenize(docs[i]) for i in range(len(docs))] == ["T1\nbody one", "T2\n"]
    assert result.num_empty == 1


def test_hf_tokenizer_with_workers_matches_serial(tmp_path):
    tok = build_tokenizer("HuggingFaceTokenizer", str(write_word_tokenizer(tmp_path / "tokenizer.json")))
    src = tmp_path / "data.jsonl"
    src.write_text(
        "".join(json.dumps({"text": "hello world " * (i % 5 + 1)}) + "\n" for i in range(40))
    )
    prepare_dataset([src], tmp_path / "serial", tok, progress=False)
    prepare_dataset([src], tmp_path / "pool", tok, workers=2, progress=False)
    serial, pool = DocumentDataset(str(tmp_path / "serial")), DocumentDataset(
        str(tmp_path / "pool")
    )
    assert (
        serial.lengths.tolist() == pool.lengths.tolist() == [2 * (i % 5 + 1) + 1 for i in range(40)]
    )
    assert all(np.array_equal(serial[i], pool[i]) for i in range(40))
    assert serial[0].tolist() == [1, 2, tok.eod]


def test_errors(tmp_path):
    with pytest.raises(DataError, match="input not found"):
        prepare_dataset([tmp_path / "absent.txt"], tmp_path / "ds", BYTE, progress=False)
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(DataError, match="no documents"):
        prepare_dataset([tmp_path / "empty.txt"], tmp_path / "ds", BYTE, progress=False)
    assert not list(tmp_path.glob("ds.*")), "a failed run must not leave partial files"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    for workers in (1, 2):
        with pytest.raises(DataError, match=r"bad.jsonl:2: no key"):
            prepare_dataset([bad], tmp_path / "ds", BYTE, workers=workers, progress=False)
    with pytest.raises(DataError, match="no input files"):
        prepare_dataset([tmp_path], tmp_path / "ds", BYTE, pattern="*.none", progress=False)


def test_script_cli(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("abc")
    assert (
        prepare_data.main(
            [
                "--input",
                str(tmp_path / "a.txt"),
                "--output-prefix",
                str(tmp_path / "ds"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert "1 docs, 4 tokens" in capsys.readouterr().out
    assert DocumentDataset(str(tmp_path / "ds"))[0].tolist() == [97, 98, 99, 256]
    bad = tmp_path / "tok.json"
    bad.write_text("garbage")
    assert (
        prepare_data.main(
            [
                "--input",
                str(tmp_path / "a.txt"),
                "--output-prefix",
                str(tmp_path / "x"),
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                str(bad),
            ]
        )
        == 2  # bad input: one line, exit 2 (as argparse and epp-plan)
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("epp-prepare-data: error: cannot parse tokenizer file") and "\n" not in err
