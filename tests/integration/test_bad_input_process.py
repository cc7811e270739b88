"""Bad flags as a user meets them: pretrain_gpt.py as a process (a flag refused by the parser, before megatron-core's
import; a data path refused after it): nothing else reaches stderr or stdout, exit status 2. The other bad-input cases
run its entry point in this process (tests/unit/test_bad_input.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.launch import REPO, run_env
from tests.unit.test_bad_input import BASE


def run_pretrain(*flags: str, world_size: int = 1, entry: tuple[str, ...] = (str(REPO / "pretrain_gpt.py"),)) -> subprocess.CompletedProcess:
    """``pretrain_gpt.py FLAGS`` as a process (``entry``: the command that stands for ``pretrain_gpt.py``)."""
    env = run_env({"WORLD_SIZE": str(world_size), "RANK": "0"})
    env.pop("PYTHONWARNINGS")  # what a user sees: pretrain_gpt.py itself keeps stderr to the one line
    return subprocess.run([sys.executable, *entry, *flags], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)


def test_a_bad_flag_is_one_line_from_the_process():
    """pretrain_gpt.py as a user runs it: a flag the parser refuses (before megatron-core's import) is one line on
    stderr, nothing on stdout, exit status 2."""
    proc = run_pretrain(*BASE, "--bogus-flag")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["pretrain_gpt.py: error: unrecognized arguments: --bogus-flag"], proc.stderr


def test_the_training_module_runs_as_pretrain_gpt():
    """``python -m megatron_epp.training.main FLAGS`` is pretrain_gpt.py: its flags parsed into the config the run
    takes (a bad one: the same one line; a config that parses runs up to its first check of the data)."""
    entry = ("-m", "megatron_epp.training.main")
    proc = run_pretrain(*BASE, "--bogus-flag", entry=entry)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["pretrain_gpt.py: error: unrecognized arguments: --bogus-flag"], proc.stderr
    proc = run_pretrain("--num-layers", "4", "--data-path", "/nonexistent/corpus", entry=entry)
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, [
        "pretrain_gpt.py: error: --data-path /nonexistent/corpus: missing /nonexistent/corpus.bin, /nonexistent/corpus.idx"]), proc.stderr


def test_missing_data_path(tmp_path):
    """As a process too: refused after megatron-core's import (its import-time warnings stay off stderr)."""
    proc = run_pretrain("--num-layers", "4", "--data-path", str(tmp_path / "corpus"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"pretrain_gpt.py: error: --data-path {tmp_path / 'corpus'}: missing {tmp_path / 'corpus'}.bin, {tmp_path / 'corpus'}.idx"
    ]
