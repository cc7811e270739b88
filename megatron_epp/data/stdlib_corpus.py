"""The default corpus: the running interpreter's standard-library sources, one ``.py`` file per
document, byte-tokenized into a cached indexed dataset. Real, skewed lengths; no download.

Build it on one rank (then barrier) in a multi-process run: the cache is not locked.
"""

from __future__ import annotations

import json
import os
import platform
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


def stdlib_files(max_files: int | None = None) -> list[Path]:
    """The stdlib's ``*.py`` files in sorted order (installed packages excluded), the first
    ``max_files`` of them when given."""
    paths = sysconfig.get_paths()
    root = Path(paths["stdlib"])
    excluded = {os.path.realpath(paths[k]) for k in ("purelib", "platlib")}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if os.path.realpath(os.path.join(dirpath, d)) not in excluded
        ]
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
        print(f"stdlib corpus (cached) {prefix}: {LengthStats.of(DocumentDataset(prefix).lengths)}")
        return prefix
    manifest_path.unlink(missing_ok=True)
    result = prepare_dataset(files, prefix, ByteTokenizer(), workers=workers, progress=progress)
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"stdlib corpus built from {len(files)} files: {result.summary()}")
    return prefix


if __name__ == "__main__":
    print(ensure_stdlib_corpus())
