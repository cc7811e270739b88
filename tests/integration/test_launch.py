"""The tests' launcher (``tests.launch.torchrun``, ranks forked from a pre-imported process: ``tests.forked``) behaves as
torchrun does where the tests rely on it: each rank's environment, its stdout and stderr passed on, exit 0 only when
every rank exits 0, a failing rank ending the others, a hang ending at the timeout, the script's exit handlers run."""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from tests.launch import torchrun

SCRIPT = '''
import atexit, os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']}/{os.environ['LOCAL_WORLD_SIZE']} "
      f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} mine {os.environ.get('MINE')} args {sys.argv[1:]}", flush=True)
print(f"to stderr from {rank}", file=sys.stderr)
atexit.register(lambda: print(f"exit handler of {rank}", flush=True))
mode = sys.argv[1]
if len(sys.argv) > 2 and mode != "ok":
    open(f"{sys.argv[2]}.{rank}", "w").write(str(os.getpid()))
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode in ("fail", "hang"):
    time.sleep(600)
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return str(path)


def test_every_rank_gets_torchruns_environment_and_its_output_is_passed_on(script):
    proc = torchrun(2, script, "ok", "x", env={"MINE": "7"})
    for rank in (0, 1):
        assert f"rank {rank} of 2 local {rank}/2 master 127.0.0.1:" in proc.stdout and f"mine 7 args ['ok', 'x']" in proc.stdout
        assert f"exit handler of {rank}" in proc.stdout and f"to stderr from {rank}" in proc.stderr
    assert proc.returncode == 0


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_failing_rank_fails_the_launch_and_ends_the_others(script, tmp_path):
    start = time.monotonic()
    proc = torchrun(2, script, "fail", str(tmp_path / "pid"), check=False, timeout=120)
    assert proc.returncode == 1 and time.monotonic() - start < 60
    assert not alive(int((tmp_path / "pid.0").read_text()))  # rank 0, asleep for 600 s, was stopped


def test_a_hang_ends_at_the_timeout(script, tmp_path):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        torchrun(2, script, "hang", str(tmp_path / "pid"), check=False, timeout=5)
    assert time.monotonic() - start < 30
    assert not any(alive(int((tmp_path / f"pid.{rank}").read_text())) for rank in (0, 1))


def test_ranks_are_forked_only_without_a_cuda_device(monkeypatch):
    import torch

    from tests.launch import LAUNCHER_ENV, launcher_mode

    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launcher_mode() == "forked"
    assert launcher_mode({"EPP_HOST_ALLOCATOR": "system"}) == "torchrun"  # the re-execution is under test
    monkeypatch.setenv(LAUNCHER_ENV, "torchrun")
    assert launcher_mode() == "torchrun"
    monkeypatch.delenv(LAUNCHER_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a forked rank cannot initialise CUDA (H200, 2026-11-27)
    assert launcher_mode() == "torchrun"
