"""Run a script under torchrun (gloo, CPU) from a test, with the repo on PYTHONPATH."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.update(extra or {})
    return env


def torchrun_command(nproc: int, script: str, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(REPO / script), *args,
    ]


def torchrun(nproc: int, script: str, *args: str, env: dict[str, str] | None = None, check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc script args``; on failure (if ``check``) raise with the log tail."""
    cmd = torchrun_command(nproc, script, *args)
    proc = subprocess.run(cmd, cwd=REPO, env=run_env(env), capture_output=True, text=True, timeout=timeout)
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


def torchrun_killed_after(line_prefix: str, nproc: int, script: str, *args: str, timeout: int = 300) -> str:
    """Start ``torchrun``, SIGKILL its whole process group once a stdout line starts with
    ``line_prefix`` (stripped), and return the output read until then."""
    proc = subprocess.Popen(torchrun_command(nproc, script, *args), cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            seen.append(line)
            if line.strip().startswith(line_prefix) or time.monotonic() > deadline:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if not seen or not seen[-1].strip().startswith(line_prefix):
        raise AssertionError(f"no line starting {line_prefix!r} before the run ended:\n{''.join(seen)[-3000:]}")
    return "".join(seen)
