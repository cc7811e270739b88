"""The default corpus: the running interpreter's standard-library sources, one ``.py`` file per
document, byte-tokenized into a cached indexed dataset. Real, skewed lengths; no download.

The standard library only, the same files on every machine with the same Python version: the modules and
packages ``sys.stdlib_module_names`` names, under ``sysconfig``'s ``stdlib`` directory. Left out: installed
packages (``site-packages``/``dist-packages``: a virtual environment's base interpreter, or a distribution's
Python, keeps them there), CPython's own regression tests (``test``, ``__hello__``, ``__phello__``: not in
``sys.stdlib_module_names``, and left out of some distributions' Python) and the files generated for one build
(``_sysconfigdata_*``, ``config-*``). A distribution that splits a stdlib package off into a package of its own
(Debian's ``idlelib``, ``tkinter``, ``lib2to3``) has fewer files unless those are installed.

Build it on one rank (then barrier) in a multi-process run: the cache is not locked.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import sysconfig
from pathlib import Path

from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_epp.data.documents import DocumentDataset
from megatron_epp.data.length_stats import LengthStats
from megatron_epp.data.prepare import prepare_dataset
from megatron_epp.data.tokenizers import ByteTokenizer

DEFAULT_CACHE_DIR = Path(__file__).resolve().parents[2] / "data_cache" / "stdlib"
PREFIX_NAME = "stdlib_py"
MANIFEST_NAME = "manifest.json"


# installed packages, and the test suites some stdlib packages carry (ctypes/test, unittest/test, lib2to3/tests,
# idlelib/idle_test; CPython 3.12 moved them under test/, and distributions ship them apart)
EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test")


def stdlib_files(max_files: int | None = None) -> list[Path]:
    """The standard library's ``*.py`` files (see the module's docstring) in sorted order, the first ``max_files``
    of them when given."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = sys.stdlib_module_names
    files = [root / f for f in os.listdir(root) if f.endswith(".py") and f[:-3] in names and (root / f).is_file()]
    for package in sorted(d for d in os.listdir(root) if d in names and (root / d).is_dir()):
        for dirpath, dirnames, filenames in os.walk(root / package):
            dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
            files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files)[:max_files]


def ensure_stdlib_corpus(
    cache_dir: str | Path | None = None,
    max_files: int | None = None,
    workers: int = 1,
    progress: bool = True,
) -> str:
    """Prefix of the stdlib corpus in ``cache_dir`` (default ``data_cache/stdlib`` in the repo),
    built on first use and reused while its manifest (stdlib, file count, tokenizer) matches."""
    cache = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    prefix = str(cache / PREFIX_NAME)
    manifest_path = cache / MANIFEST_NAME
    files = stdlib_files(max_files)
    manifest = {
        "stdlib": sysconfig.get_paths()["stdlib"],
        "python": platform.python_version(),
        "files": len(files),
        "tokenizer": ByteTokenizer.name,
    }
    if (
        manifest_path.is_file()
        and json.loads(manifest_path.read_text()) == manifest
        and IndexedDataset.exists(prefix)
    ):
        print(f"stdlib corpus (cached) {prefix}: {len(files):,} files of the Python {manifest['python']} standard library, "
              f"{LengthStats.of(DocumentDataset(prefix).lengths)}")
        return prefix
    manifest_path.unlink(missing_ok=True)
    result = prepare_dataset(files, prefix, ByteTokenizer(), workers=workers, progress=progress)
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"stdlib corpus built from {len(files):,} files of the Python {manifest['python']} standard library: {result.summary()}")
    return prefix


if __name__ == "__main__":
    print(ensure_stdlib_corpus())
