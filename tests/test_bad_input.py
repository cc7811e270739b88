"""Bad flags fail fast with one line on stderr and a non-zero exit, before any process group work."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.launch import REPO, run_env

BASE = ["--mock-data", "--num-layers", "4"]


def run_pretrain(*flags: str, world_size: int = 1) -> subprocess.CompletedProcess:
    env = run_env({"WORLD_SIZE": str(world_size), "RANK": "0"})
    env.pop("PYTHONWARNINGS")  # what a user sees: pretrain_gpt.py itself keeps stderr to the one line
    return subprocess.run(
        [sys.executable, str(REPO / "pretrain_gpt.py"), *flags], cwd=REPO, capture_output=True, text=True,
        env=env, timeout=120,
    )


@pytest.mark.parametrize(
    "flags, world_size, message",
    [
        (["--bogus-flag"], 1, "unrecognized arguments: --bogus-flag"),
        (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
        (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "--global-batch-size 6 is not divisible"),
        (["--global-batch-size", "6", "--micro-batch-size", "2"], 4, "data parallel 4"),
        (["--num-layers", "abc"], 1, "invalid int value: 'abc'"),
        (["--epp-plan", "seq1f1b"], 1, "--epp-plan needs --elastic-pp"),
        (["--train-iters", "3", "--lr-warmup-iters", "3"], 1, "--lr-warmup-iters 3 must be smaller than --lr-decay-iters 3"),
        (["--elastic-pp", "--recompute-granularity", "full", "--recompute-method", "uniform"], 1,
         "--recompute-granularity does not apply with --elastic-pp"),
        (["--elastic-pp", "--micro-batch-size", "2"], 1, "--micro-batch-size does not apply with --elastic-pp"),
        (["--elastic-pp", "--epp-memory-budget", "0"], 1, "--epp-memory-budget must be positive"),
        (["--elastic-pp", "--seq-length", "2048", "--epp-memory-budget", "0.01"], 1, "cannot be planned"),
    ],
)
def test_bad_flags_give_one_line_error(flags, world_size, message):
    start = time.perf_counter()
    proc = run_pretrain(*BASE, *flags, world_size=world_size)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert time.perf_counter() - start < 20  # no model, no process group


def test_missing_data_path(tmp_path):
    proc = run_pretrain("--num-layers", "4", "--data-path", str(tmp_path / "corpus"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"pretrain_gpt.py: error: --data-path {tmp_path / 'corpus'}: missing {tmp_path / 'corpus'}.bin, {tmp_path / 'corpus'}.idx"
    ]


def test_mock_and_data_path_are_exclusive(tmp_path):
    proc = run_pretrain(*BASE, "--data-path", str(tmp_path / "x"))
    assert proc.returncode == 2 and "exactly one of --mock-data and --data-path" in proc.stderr
