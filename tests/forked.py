"""Launch a script's ranks as torchrun does, but forked from a process that has already imported torch, megatron-core
and the training driver: the tests' launches (``tests.launch.torchrun``) skip the 6-8 s each process spends importing
them on a 2-core machine.

The ranks are ``multiprocessing``'s forkserver children: the forkserver starts once per test session (this module
preloaded, so the heavy imports happen there once, with jemalloc preloaded as ``pretrain_gpt.py`` re-executes itself
with it), and each rank is a fork of it that takes the launch's environment, working directory and arguments, the
variables torchrun gives a worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ...), writes its stdout and stderr to the launch's two files, and runs the script as ``__main__``.
As torchrun does, the launch fails (exit 1) when a rank does, and the other ranks are then stopped (SIGTERM, SIGKILL
after a grace); past ``timeout`` every rank is killed and ``subprocess.TimeoutExpired`` raised. What needs torchrun
itself (signals to the launcher, its shutdown, SLURM) starts torchrun (``tests.launch``'s other helpers).
"""

from __future__ import annotations

import atexit
import ctypes.util
import io
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Sequence

# what every rank would import: loaded once in the forkserver
warnings.filterwarnings("ignore", message="(Transformer Engine and )?Apex (is|are) not installed")
import torch  # noqa: E402,F401
import megatron_epp.training.main  # noqa: E402,F401

from megatron_epp.training import host_allocator  # noqa: E402

GRACE_S = 10.0  # between SIGTERM and SIGKILL of the ranks left when one failed


def _jemalloc_env() -> dict[str, str]:
    """The variables ``pretrain_gpt.py``'s re-execution sets where jemalloc is installed (none where it is not)."""
    library = ctypes.util.find_library("jemalloc")
    if library is None or os.environ.get(host_allocator.ENV, "auto") == "system":
        return {}
    return {host_allocator.PRELOADED: library, "LD_PRELOAD": library, "MALLOC_CONF": os.environ.get("MALLOC_CONF", host_allocator.JEMALLOC_CONF)}


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started (once) with jemalloc preloaded and this module imported."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    extra = _jemalloc_env()
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return context


def _rank_main(script: str, args: Sequence[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """One rank, in a fork of the forkserver: the launch's environment, files and arguments, the script as __main__."""
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:  # noqa: BLE001  (as an uncaught exception ends a process: its traceback, exit 1)
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # as an interpreter's exit runs them (the script's own, e.g. a count printed at exit)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(nproc: int, script: str, args: Sequence[str], env: dict[str, str], cwd: str, timeout: float, port: int,
        command: list[str]) -> subprocess.CompletedProcess:
    """``nproc`` ranks of ``script args`` under ``env`` in ``cwd``; their stdout and stderr (all ranks', as torchrun
    passes them on), exit 0 when every rank exited 0, else 1 (the first failure stops the others)."""
    context = _context()
    with tempfile.TemporaryDirectory(prefix="epp-forked-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        ranks = []
        for rank in range(nproc):
            rank_env = {**env, **_jemalloc_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            process = context.Process(target=_rank_main, args=(script, list(args), rank_env, cwd, out, err))
            process.start()
            ranks.append(process)
        code = _wait(ranks, timeout)
        text = [Path(p).read_text(errors="replace") if os.path.exists(p) else "" for p in (out, err)]
    if code is None:
        raise subprocess.TimeoutExpired(command, timeout, output=text[0], stderr=text[1])
    return subprocess.CompletedProcess(command, code, text[0], text[1])


def _wait(ranks: list, timeout: float) -> int | None:
    """0 when every rank exits 0; 1 when one fails (the others stopped); None past ``timeout`` (all killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.exitcode for p in ranks]
        if any(c not in (None, 0) for c in codes):
            _stop(ranks)
            return 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)
    for p in ranks:
        p.kill()
        p.join()
    return None


def _stop(ranks: list) -> None:
    for p in ranks:
        if p.exitcode is None:
            p.terminate()
    end = time.monotonic() + GRACE_S
    for p in ranks:
        p.join(max(0.0, end - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
