"""Long runs as a cluster runs them: stopping cleanly on SIGTERM / an iteration / a duration, stopping
on a NaN/Inf, and the test-only fault injection.

Every decision to stop is taken by all ranks together (one all-reduce at the end of a step), so that
all of them save the same checkpoint and leave at the same point.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_epp.config.errors import ArgumentError
from megatron_epp.config.fields import TrainingSection

FAULT_ENV = "EPP_FAULT_INJECT"
FAULT_KINDS = ("nan_loss", "nan_grad", "crash_in_save", "hang", "oom", "oom_every")
OOM_OPS = {"F": "forward", "B": "backward", "R": "recompute", "T": "transfer"}


class TrainingFault(RuntimeError):
    """A condition that stops training with one line on stderr and a non-zero exit (:func:`report_fault`). Raised on
    every rank alike: each decision to raise one is taken together (a collective names the cause to all)."""


def report_fault(error: TrainingFault, is_logging_rank: bool) -> None:
    """Every rank, on the way out of a :class:`TrainingFault`: the logging rank writes the one error line
    (``pretrain_gpt.py: error: ...``) and no rank returns before it is written, so the line is on stderr whichever
    rank's exit a launcher sees first (torchrun stops the other ranks at the first exit that is not 0). Where the
    ranks can no longer meet (a rank gone), each rank that cannot writes the line itself: it is never lost."""
    line = f"pretrain_gpt.py: error: {error}"
    if is_logging_rank:
        print(line, file=sys.stderr, flush=True)
    try:
        dist.barrier()  # after the logging rank's write and flush
    except Exception:  # noqa: BLE001  (a peer gone: a broken connection, whatever the backend calls it)
        if not is_logging_rank:
            print(line, file=sys.stderr, flush=True)


class SigtermHandler:
    """``--exit-signal-handler``: SIGTERM only sets a flag on this rank; the ranks agree on it at the end
    of the step (:meth:`ExitConditions.reason`). Megatron-LM's DistributedSignalHandler does the same."""

    def __init__(self) -> None:
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


class ExitConditions:
    """``--exit-signal-handler``, ``--exit-interval``, ``--exit-duration-in-mins``: whether to save and
    stop after an iteration. The signal and the duration are agreed on by one all-reduce (max) of
    ``[SIGTERM seen, minutes elapsed]``, made only when one of them is on."""

    def __init__(self, run: TrainingSection, device: torch.device, start_time: float,
                 handler: SigtermHandler | None = None) -> None:
        """``handler``: one installed earlier (main installs it once the process group exists, so that a SIGTERM
        during the checkpoint load or the model's build is not lost); else one is installed here."""
        self.interval = run.exit_interval
        self.duration_mins = run.exit_duration_in_mins
        self.start_time = start_time
        self.device = device
        self.handler = handler if handler is not None or not run.exit_signal_handler else SigtermHandler()

    def reason(self, iteration: int) -> str | None:
        """Why to stop after ``iteration`` (the same answer on every rank), or None."""
        if self.handler is not None or self.duration_mins is not None:
            flags = torch.tensor(
                [float(self.handler is not None and self.handler.received), (time.time() - self.start_time) / 60],
                dtype=torch.float64, device=self.device,
            )
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if flags[0] > 0:
                return "SIGTERM received (--exit-signal-handler)"
            if self.duration_mins is not None and flags[1] > self.duration_mins:
                return f"{float(flags[1]):.2f} minutes elapsed (--exit-duration-in-mins {self.duration_mins})"
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval}"
        return None

    def close(self) -> None:
        if self.handler is not None:
            self.handler.restore()


def check_finite(iteration: int, local_loss: torch.Tensor | None, grad_buffers, rank: int, device: torch.device) -> None:
    """``--check-for-nan-in-loss-and-grad`` (on by default, as Megatron-LM): raise :class:`TrainingFault` on every rank when some rank's
    loss (before the data-parallel reduction; last stage only) or gradient buffer holds a NaN/Inf.

    One all-reduce (min) of ``2 * rank + what`` (what: 0 loss, 1 grad; world size x 2 when all is
    finite) names the first rank that saw one; run before the optimizer step, so no update is applied.

    Why not megatron-core's ``DistributedDataParallelConfig(check_for_nan_in_grad=True)`` for the gradient
    part (0.16.1, ``_ParamAndGradBucketGroup.check_grads``): it goes through the rerun state machine, which in
    its default (disabled) mode raises a RuntimeError on the one rank that saw the NaN, before the
    data-parallel reduction; the other ranks learn of it only when that rank's exit breaks their next
    collective: no agreed stop, and tracebacks rather than one line. Its
    message names the state machine's own iteration counter (-1 unless the training loop drives the machine's
    ``should_run_forward_backward``, which neither schedule here does) and calls
    ``torch.cuda.current_device()``, which fails on a CPU-only build before the message is made. It reads one
    norm per bucket on the host, and sees no loss (Megatron-LM checks the loss in its own training loop).
    What it has and this check lacks: it looks before the reduction, so it names the replica where a NaN
    arose; here, after it, the rank named is the lowest that holds one (with dp > 1, maybe a replica of it).
    """
    # decided on the device: one host read in all (after the all-reduce), not one per gradient buffer. A buffer's
    # sum is NaN/Inf when one of its elements is (NaN and Inf propagate), and costs one read of the buffer: on by
    # default, the check must be cheap (isfinite().all() writes a mask as large as the buffer, ~16x slower on a
    # CPU). Its one false alarm, a sum beyond 3e38 of finite gradients, is an already diverged run; megatron-core's
    # own check (a norm per bucket) overflows sooner, at gradients near 1e19.
    ok = torch.ones((), dtype=torch.bool, device=device)
    loss_ok = torch.isfinite(local_loss).all() if local_loss is not None else ok
    grads_ok = torch.isfinite(torch.stack([b.grad_data.sum() for b in grad_buffers])).all() if grad_buffers else ok
    flag = torch.where(loss_ok, torch.where(grads_ok, 2 * dist.get_world_size(), 2 * rank + 1), 2 * rank)
    flag = flag.to(torch.int64).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    bad_rank, what = divmod(int(flag.item()), 2)
    if bad_rank < dist.get_world_size():
        raise TrainingFault(
            f"--check-for-nan-in-loss-and-grad: {'the loss' if what == 0 else 'a gradient'} is NaN/Inf at "
            f"iteration {iteration} on rank {bad_rank}; stopped without updating the parameters"
        )


@dataclass(frozen=True)
class FaultInjection:
    """Test-only: ``EPP_FAULT_INJECT=KIND@ITERATION[:RANK]`` (read once in main) plants one fault:
    ``nan_loss`` (the last stage's loss of that iteration), ``nan_grad`` (the gradients of ``RANK``,
    default 0), ``crash_in_save`` (``RANK`` fails as on a full disk, after writing its part of that
    iteration's checkpoint, before it is committed) or ``hang`` (``RANK`` stops answering at the start of that
    iteration, as a rank stuck in a kernel or on a lost node, until it is killed). ``oom@ITERATION:RANK:OP[:CHUNK]``
    (``--elastic-pp``): ``RANK`` raises ``torch.OutOfMemoryError`` in the first run of that iteration's batch, before
    the ``OP`` of a chunk (``CHUNK``: its plan id, or its kind, ``batched``, ``split`` or ``hybrid``; default any: the
    first such op): ``F`` a forward, ``B`` a backward, ``R`` a recomputing layer's forward inside a backward, ``T`` a
    send/receive (as when its receive buffer cannot be allocated); ``oom_every@...`` the same in every run of that
    batch (each plan of it, until the run gives up). No effect when the variable is unset."""

    kind: str | None = None
    iteration: int = 0
    rank: int = 0
    op: str = "F"
    chunk: int | str | None = None

    @classmethod
    def from_env(cls) -> FaultInjection:
        spec = os.environ.get(FAULT_ENV, "")
        if not spec:
            return cls()
        try:
            kind, at = spec.split("@")
            iteration, rank, *where = at.split(":") + ([] if ":" in at else ["0"])
            if len(where) > (2 if kind.startswith("oom") else 0) or (where and where[0] not in OOM_OPS):
                raise ValueError(spec)
            chunk = [c if c in ("batched", "split", "hybrid") else int(c) for c in where[1:]]
            fault = cls(kind, int(iteration), int(rank or 0), *(where[:1] or ["F"]), *chunk)
        except ValueError:
            fault = cls("?")
        if fault.kind not in FAULT_KINDS:
            raise ArgumentError(f"{FAULT_ENV}={spec}: expected KIND@ITERATION[:RANK] (KIND one of {', '.join(FAULT_KINDS)}) "
                                f"or oom@ITERATION:RANK:OP[:CHUNK] (OP one of {', '.join(OOM_OPS)})")
        return fault

    def oom_hook(self, iteration: int, rank: int, attempt: int) -> Callable[[str, Any], None] | None:
        """The chunk context's fault hook that plants this ``oom`` fault on ``rank`` in run ``attempt`` (1: the first)
        of ``iteration``'s batch (once in that run), or None."""
        if not (self.at("oom", iteration, rank) and attempt == 1 or self.at("oom_every", iteration, rank)):
            return None
        fired: list[bool] = []

        def hook(kind: str, layout: Any) -> None:
            if not fired and kind == self.op and self.chunk in (None, layout.chunk.id, layout.chunk.kind):
                fired.append(True)
                raise torch.OutOfMemoryError(f"CUDA out of memory (planted by {FAULT_ENV}: rank {rank}, iteration {iteration}, "
                                             f"before the {OOM_OPS[kind]} of chunk {layout.chunk.id})")

        return hook

    def at(self, kind: str, iteration: int, rank: int | None = None) -> bool:
        return self.kind == kind and self.iteration == iteration and (rank is None or rank == self.rank)

    def poison_loss(self, iteration: int, losses: list[dict[str, torch.Tensor]]) -> None:
        if self.at("nan_loss", iteration):
            for d in losses:
                d["lm loss"] = d["lm loss"] * math.nan

    def poison_grads(self, iteration: int, rank: int, grad_buffers) -> None:
        if self.at("nan_grad", iteration, rank):
            grad_buffers[0].grad_data.view(-1)[0] = math.nan

    def hang(self, iteration: int, rank: int) -> None:
        if self.at("hang", iteration, rank):
            while True:
                time.sleep(60)

    def crash_in_save(self, iteration: int, rank: int) -> None:
        if self.at("crash_in_save", iteration, rank):
            raise OSError(errno.ENOSPC, f"{FAULT_ENV}: rank {rank} crashes while saving iteration {iteration}")
