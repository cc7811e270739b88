"""pretrain_gpt.py's host allocator (megatron_epp.training.host_allocator): jemalloc preloaded by one re-execution
where installed, as EPP_HOST_ALLOCATOR asks; the start-up log names what runs."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from megatron_epp.training import host_allocator
from tests.paths import REPO



class Exec(Exception):
    pass


@pytest.fixture
def execve(monkeypatch):
    calls = []

    def fake(path, argv, env):
        calls.append((path, argv, env))
        raise Exec

    monkeypatch.setattr(host_allocator.os, "execve", fake)
    for key in (host_allocator.ENV, host_allocator.PRELOADED, "MALLOC_CONF", "LD_PRELOAD"):
        monkeypatch.delenv(key, raising=False)
    return calls


def test_auto_reexecutes_once_with_jemalloc_preloaded(monkeypatch, execve):
    monkeypatch.setattr(host_allocator.ctypes.util, "find_library", lambda name: "libjemalloc.so.2" if name == "jemalloc" else None)
    monkeypatch.setenv("LD_PRELOAD", "libother.so")
    with pytest.raises(Exec):
        host_allocator.reexec_with_jemalloc()
    (path, argv, env), = execve
    assert path == sys.executable and argv == sys.orig_argv
    assert env["LD_PRELOAD"] == "libjemalloc.so.2:libother.so" and env["MALLOC_CONF"] == host_allocator.JEMALLOC_CONF
    assert env[host_allocator.PRELOADED] == "libjemalloc.so.2"
    monkeypatch.setenv("MALLOC_CONF", "narenas:1")  # the user's own configuration is kept
    with pytest.raises(Exec):
        host_allocator.reexec_with_jemalloc()
    assert execve[-1][2]["MALLOC_CONF"] == "narenas:1"
    monkeypatch.setenv(host_allocator.PRELOADED, "libjemalloc.so.2")  # the re-executed process: not again
    host_allocator.reexec_with_jemalloc()
    assert len(execve) == 2
    assert host_allocator.describe().startswith("jemalloc (libjemalloc.so.2, MALLOC_CONF=narenas:1")


def test_system_or_missing_library_runs_as_is_and_says_so(monkeypatch, execve):
    monkeypatch.setattr(host_allocator.ctypes.util, "find_library", lambda name: None)
    host_allocator.reexec_with_jemalloc()  # auto without the library
    assert host_allocator.describe() == "the system's malloc (libjemalloc not installed)"
    monkeypatch.setenv(host_allocator.ENV, "jemalloc")
    with pytest.raises(ValueError, match="EPP_HOST_ALLOCATOR=jemalloc but libjemalloc is not installed"):
        host_allocator.reexec_with_jemalloc()
    monkeypatch.setattr(host_allocator.ctypes.util, "find_library", lambda name: "libjemalloc.so.2")
    monkeypatch.setenv(host_allocator.ENV, "system")
    host_allocator.reexec_with_jemalloc()
    assert not execve and host_allocator.describe() == "the system's malloc (EPP_HOST_ALLOCATOR=system)"
    monkeypatch.setenv(host_allocator.ENV, "auto")  # installed, but this process was not re-executed: not "not installed"
    assert host_allocator.describe() == "the system's malloc (libjemalloc installed, not preloaded: pretrain_gpt.py preloads it at start)"


def test_bad_value_is_one_line_before_any_work():
    env = {**os.environ, host_allocator.ENV: "tcmalloc", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--mock-data"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: EPP_HOST_ALLOCATOR='tcmalloc': expected one of auto, jemalloc, system"]


def test_the_trained_process_runs_on_the_allocator_it_names(tmp_path):
    """A real run (one process): with jemalloc installed it re-executes under it (the library is mapped into the
    process that trains); without it, it says so. The first line also holds in CI, which installs libjemalloc2."""
    probe = tmp_path / "maps.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "EPP_TEST_MAPS": str(probe)}
    env.pop(host_allocator.PRELOADED, None)
    env.pop(host_allocator.ENV, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "tests/workers/allocator_probe.py",
                           "--mock-data", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "32",
                           "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    mapped = "libjemalloc" in probe.read_text()
    if ctypes.util.find_library("jemalloc"):
        assert mapped and "> host allocator: jemalloc (libjemalloc.so.2, MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1" in proc.stdout
    else:
        assert not mapped and "> host allocator: the system's malloc (libjemalloc not installed)" in proc.stdout
