"""``python -m megatron_epp.training.launch [torchrun options] pretrain_gpt.py [flags]``: torchrun, with preemption
that exits 0 however SIGTERM arrives.

Every launch script of the repository (examples/*.sh, scripts/train_default.sh, scripts/slurm/train.sbatch) starts
training through this module, with torchrun's own options. What it adds to ``python -m torch.distributed.run``:

- a run that saves (``--save``) gets ``--exit-signal-handler``: on SIGTERM every rank finishes its step, saves a
  checkpoint and exits 0;
- torchrun itself then ignores SIGTERM (``--signals-to-handle`` without it; ignored, not left to its default
  action), so it never stops its ranks in the middle of that save, and it ends with its ranks' status, 0 after a
  clean save: torchrun alone, sent SIGTERM (as a scheduler or ``docker stop`` may), forwards it to its ranks, gives
  them 30 s and exits 1 whatever they did;
- SIGTERM sent to this launcher is forwarded to every rank, again each second until they have all exited (a rank
  still starting up inherits the ignored SIGTERM until pretrain_gpt.py installs its handler); SIGTERM sent to the
  ranks directly (SLURM signals every process of the job) is handled by them, and the launcher's copy is harmless.

SIGINT, SIGHUP and SIGQUIT keep torchrun's handling (a terminal's Ctrl-C reaches torchrun through the process
group, which it shares with the launcher; the launcher ignores them). A run without ``--save`` is torchrun
unchanged (the process is replaced by it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Sequence

import psutil

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SIGNALS_FLAG = "--signals-to-handle"
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default
FORWARD_EVERY_S = 1.0


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(torchrun's options, [script, *its flags])``: the script is the first argument ending in ``.py`` (none:
    ``--help``, or a command line torchrun will refuse)."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py") and not arg.startswith("-"):
            return list(argv[:i]), list(argv[i:])
    return list(argv), []


def _flag_given(flags: Sequence[str], name: str) -> bool:
    return any(f == name or f.startswith(name + "=") for f in flags)


def torchrun_command(argv: Sequence[str]) -> tuple[list[str], bool]:
    """The torchrun command line for ``argv``, and whether the ranks stop cleanly on SIGTERM (then torchrun must
    leave SIGTERM to them)."""
    options, script = split_command(argv)
    if not script:
        return [*TORCHRUN, *options], False
    if _flag_given(script[1:], "--save") and not _flag_given(script[1:], "--exit-signal-handler"):
        script.append("--exit-signal-handler")
    clean_stop = _flag_given(script[1:], "--exit-signal-handler")
    if clean_stop:
        signals, kept_options, i = TORCHRUN_SIGNALS, [], 0
        while i < len(options):
            name, eq, value = options[i].partition("=")
            if name in (SIGNALS_FLAG, "--signals_to_handle") and (eq or i + 1 < len(options)):
                signals, i = (value, i + 1) if eq else (options[i + 1], i + 2)
                continue
            kept_options.append(options[i])
            i += 1
        kept = ",".join(s.strip() for s in signals.split(",") if s.strip() not in ("", "SIGTERM"))
        options = [*kept_options, SIGNALS_FLAG, kept or "SIGINT"]  # left out, torchrun's default handles SIGTERM
    return [*TORCHRUN, *options, *script], clean_stop


def _ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run(argv: Sequence[str]) -> int:
    """Start torchrun, forward SIGTERM to its ranks, and return its exit status."""
    command, clean_stop = torchrun_command(argv)
    if not clean_stop:
        os.execv(command[0], command)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)  # torchrun gets them through the process group and handles them
    torchrun: subprocess.Popen | None = None
    forwarded_at: float | None = None  # when SIGTERM was last forwarded to the ranks; None: not received

    def forward() -> None:
        nonlocal forwarded_at
        forwarded_at = time.monotonic() if torchrun is not None else 0.0  # 0: as soon as torchrun has started
        try:
            ranks = psutil.Process(torchrun.pid).children() if torchrun is not None else []
        except psutil.Error:  # torchrun just exited
            ranks = []
        for rank in ranks:
            try:
                rank.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass

    def on_sigterm(signum, frame) -> None:
        if forwarded_at is None:
            print("launch: SIGTERM: forwarded to the ranks, which save and exit", file=sys.stderr, flush=True)
        forward()

    signal.signal(signal.SIGTERM, on_sigterm)
    torchrun = subprocess.Popen(command, preexec_fn=_ignore_sigterm)
    while True:
        try:
            status = torchrun.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        if forwarded_at is not None and time.monotonic() - forwarded_at >= FORWARD_EVERY_S:
            forward()  # again: a rank that was still starting (SIGTERM ignored until its handler is installed)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
