"""The embedded stdlib corpus: built from sorted stdlib sources, cached by manifest; the standard library only."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from megatron_epp.data import stdlib_corpus
from megatron_epp.data.documents import DocumentDataset
from megatron_epp.data.tokenizers import ByteTokenizer
from tests.paths import REPO


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


def test_the_standard_library_only_and_the_same_from_a_virtual_environment(tmp_path):
    """No installed package (the interpreter's site-packages, which sysconfig's stdlib directory holds), no test
    suite, no build-specific file; from a virtual environment (its base interpreter's site-packages visible) the
    same files."""
    files = stdlib_corpus.stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    tops = {f.relative_to(root).parts[0].removesuffix(".py") for f in files}
    assert tops <= set(sys.stdlib_module_names) and {"os", "json", "asyncio", "email"} <= tops
    assert not any(part in ("site-packages", "dist-packages", "test", "tests") for f in files for part in f.relative_to(root).parts)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    probe = "import json; from megatron_epp.data.stdlib_corpus import stdlib_files; print(json.dumps([str(f) for f in stdlib_files()]))"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], check=True, capture_output=True, text=True,
                         cwd=REPO, env={"PYTHONPATH": str(REPO),
                                                                          "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"})
    from_venv = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"stdlib corpus: {len(files)} files, the same from a virtual environment: {from_venv == [str(f) for f in files]}")
    assert from_venv == [str(f) for f in files]
