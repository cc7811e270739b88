"""Run a script under torchrun (gloo, CPU) from a test, with the repo on PYTHONPATH."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import psutil
from tests.paths import REPO



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# set in this process by megatron-core's LanguageModule whenever a test builds a model here (its --attention-backend
# bookkeeping for Transformer Engine); a child inheriting them would refuse another --attention-backend
MEGATRON_SET_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def run_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launched run: this one without what in-process model builds left in it."""
    env = {k: v for k, v in os.environ.items() if k not in MEGATRON_SET_ENV}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.update(extra or {})
    return env


LAUNCHER = "megatron_epp.training.launch"  # torchrun wrapped as every launch script of the repository starts it


def torchrun_command(nproc: int, script: str, *args: str, launcher: bool = False) -> list[str]:
    """torchrun's command line; ``launcher``: through :data:`LAUNCHER` (same options)."""
    return [
        sys.executable, "-m", LAUNCHER if launcher else "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(REPO / script), *args,
    ]


LAUNCHER_ENV = "EPP_TEST_LAUNCHER"  # "torchrun": every launch through torchrun itself (default "forked": tests.forked)


def launcher_mode(env: dict[str, str] | None = None) -> str:
    """``"torchrun"`` or ``"forked"`` for a launch with ``env``: torchrun where ``EPP_TEST_LAUNCHER=torchrun``, where the
    run chooses its host allocator (``EPP_HOST_ALLOCATOR``: the re-execution is what it tests) and where a CUDA device
    is visible (a rank forked from a process that imported torch and megatron-core cannot initialise CUDA: "Cannot
    re-initialize CUDA in forked subprocess", seen on an H200 on 2026-11-27); else forked."""
    import torch

    if os.environ.get(LAUNCHER_ENV, "forked") == "torchrun" or "EPP_HOST_ALLOCATOR" in (env or {}) or torch.cuda.is_available():
        return "torchrun"
    return "forked"


def torchrun(nproc: int, script: str, *args: str, env: dict[str, str] | None = None, check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc script args``; on failure (if ``check``) raise with the log tail. The ranks are
    forked from a process that imported torch and megatron-core once (:mod:`tests.forked`: what torchrun gives a
    worker, and its exit status), unless :func:`launcher_mode` says torchrun."""
    cmd = torchrun_command(nproc, script, *args)
    if launcher_mode(env) == "torchrun":
        proc = subprocess.run(cmd, cwd=REPO, env=run_env(env), capture_output=True, text=True, timeout=timeout)
    else:
        from tests import forked  # torch and megatron-core: imported here, once, and in the forkserver

        proc = forked.run(nproc, str(REPO / script), args, run_env(env), str(REPO), timeout, int(cmd[cmd.index("--master-port") + 1]), cmd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def logged_losses(stdout: str) -> dict[int, str]:
    """``{iteration: printed lm loss}`` from pretrain_gpt's iteration lines."""
    out = {}
    for line in stdout.splitlines():
        if line.lstrip().startswith("iteration") and "lm loss:" in line:
            it = int(line.split()[1].split("/")[0])
            out[it] = line.split("lm loss:")[1].split("|")[0].strip()
    return out


def _start_torchrun(nproc: int, script: str, args: tuple[str, ...], env: dict[str, str] | None, stderr,
                    launcher: bool = False) -> subprocess.Popen:
    return subprocess.Popen(torchrun_command(nproc, script, *args, launcher=launcher), cwd=REPO, env=run_env(env), stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=True)


def _kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's process group and its workers (in sessions of their own: they hold its stdout open)."""
    ranks = list(_ranks(proc).values())
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for rank in ranks:
        try:
            rank.kill()
        except psutil.Error:
            pass


def _read_until(proc: subprocess.Popen, line_prefix: str, timeout: float) -> list[str]:
    """Lines of ``proc``'s stdout up to the first that starts with ``line_prefix`` (stripped); raise if none
    came before the run ended or within ``timeout`` seconds (a job that hangs silently is killed then, so the
    read ends: the deadline does not wait for a line to arrive)."""
    seen: list[str] = []
    watchdog = threading.Timer(timeout, _kill_job, (proc,))
    watchdog.start()
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.strip().startswith(line_prefix):
                break
    finally:
        watchdog.cancel()
    if not seen or not seen[-1].strip().startswith(line_prefix):
        raise AssertionError(f"no line starting {line_prefix!r} within {timeout:g} s or before the run ended:\n{''.join(seen)[-3000:]}")
    return seen


def _ranks(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    """torchrun's live workers by global rank (they run in sessions of their own; under the launcher they are its
    grandchildren)."""
    workers = {}
    try:
        for child in psutil.Process(proc.pid).children(recursive=True):
            rank = child.environ().get("RANK")
            if rank is not None:
                workers[int(rank)] = child
    except psutil.Error:  # torchrun or a worker already gone
        pass
    return workers


def torchrun_killed_after(line_prefix: str, nproc: int, script: str, *args: str, timeout: int = 300) -> str:
    """Start ``torchrun``, SIGKILL it and every rank once a stdout line starts with ``line_prefix``
    (stripped), and return the output read until then."""
    proc = _start_torchrun(nproc, script, args, None, subprocess.DEVNULL)
    try:
        seen = _read_until(proc, line_prefix, timeout)
    finally:
        ranks = list(_ranks(proc).values())
        os.killpg(proc.pid, signal.SIGKILL)
        for rank in ranks:
            rank.kill()
        proc.wait()
    return "".join(seen)


@dataclass
class SignalledRun:
    returncode: int
    output: str  # stdout and stderr together
    seconds_to_exit: float  # from the signal to torchrun's exit
    ranks_left: int  # rank processes still alive after torchrun's exit


def torchrun_signalled_after(line_prefix: str, sig: int, ranks: Sequence[int] | None, nproc: int, script: str, *args: str,
                             env: dict[str, str] | None = None, timeout: int = 300, launcher: bool = False) -> SignalledRun:
    """Start ``torchrun`` (``launcher``: through :data:`LAUNCHER`); once a stdout line starts with ``line_prefix``,
    send ``sig`` to the ranks ``ranks`` (None: to the launching process itself, which forwards SIGTERM to its
    ranks); let the job end by itself (killed after ``timeout`` seconds in all) and time how long it took."""
    proc = _start_torchrun(nproc, script, args, env, subprocess.STDOUT, launcher)
    start = time.monotonic()
    try:
        seen = _read_until(proc, line_prefix, timeout)
        workers = _ranks(proc)
        if ranks is None:
            proc.send_signal(sig)
        else:
            for rank in ranks:
                workers[rank].send_signal(sig)
        signalled = time.monotonic()
        rest: list[str] = []
        reader = threading.Thread(target=lambda: rest.append(proc.stdout.read()), daemon=True)
        reader.start()
        proc.wait(timeout=max(1.0, timeout - (signalled - start)))
        seconds = time.monotonic() - signalled
        reader.join(timeout=10)
        left = [w for w in workers.values() if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
        for worker in left:
            worker.kill()
        return SignalledRun(proc.returncode, "".join(seen + rest), seconds, len(left))
    finally:
        if proc.poll() is None:
            for worker in _ranks(proc).values():
                worker.kill()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
