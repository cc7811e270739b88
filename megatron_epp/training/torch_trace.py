"""``--profile``: Megatron-LM's profiling of the training iterations ``[--profile-step-start, --profile-step-end)``
on the ranks of ``--profile-ranks``.

Iterations are counted as the log counts them (the first is 1). Without ``--use-pytorch-profiler`` each profiled
rank calls ``cudaProfilerStart`` before the first of them and ``cudaProfilerStop`` after the last, with
``torch.autograd.profiler.emit_nvtx(record_shapes=True)`` in between, so that ``nsys profile
--capture-range=cudaProfilerApi --capture-range-end=stop`` captures those iterations with NVTX ranges of the
autograd ops; on a CPU there is nothing for nsys to capture and the run trains unprofiled (a start-up line says
so). With it, a ``torch.profiler.profile`` on each profiled rank records those iterations (CPU activities, and
CUDA's on a GPU; ``record_shapes``, ``with_stack``) and writes its trace under ``--tensorboard-dir`` with
``torch.profiler.tensorboard_trace_handler``, as Megatron-LM, and a log line names the file. Either way the
elastic schedule names each chunk's forward and backward in the trace (``epp F p0 c3 split 4096t stage 1``,
:mod:`megatron_epp.executor.schedule`).

Megatron-LM counts its two modes differently: its torch.profiler steps once before each iteration of the run and
so records (on a fresh run) the iterations its log numbers start to end - 1, as here; its nsys capture starts when
its count of completed iterations equals start, one iteration later. Here both record start to end - 1, and a
resumed run profiles what is left of them.
"""

from __future__ import annotations

import os
import socket

import torch

from megatron_epp.config.fields import TrainingConfig
from megatron_epp.model.runtime import Runtime


def trace_schedule(start: int, end: int, resumed_at: int = 0) -> tuple[int, int, int] | None:
    """``torch.profiler.schedule``'s ``(wait, warmup, active)`` that record iterations ``[start, end)`` of a run
    whose first iteration is ``resumed_at + 1``, the profiler started before it and stepped once before each
    iteration (step k runs iteration ``resumed_at + k``): Megatron-LM's ``wait = max(start - 1, 0)``, ``warmup = 1
    if start > 0 else 0``, ``active = end - start``, with start and end counted from ``resumed_at``. None where no
    iteration of them is left to run."""
    first, stop = max(start - resumed_at, 0), end - resumed_at
    if stop <= max(first, 1):
        return None
    return max(first - 1, 0), 1 if first > 0 else 0, stop - first


def startup_note(cfg: TrainingConfig, device: torch.device, resumed_at: int = 0) -> str | None:
    """The start-up line on ``--profile`` (None without it)."""
    p = cfg.profile
    if not p.enabled:
        return None
    ranks = ", ".join(map(str, p.ranks))
    which = f"iterations {max(p.step_start, 1)} to {p.step_end - 1} on rank{'s' if len(p.ranks) > 1 else ''} {ranks}"
    if trace_schedule(p.step_start, p.step_end, resumed_at) is None:
        return f"profile: {which}: all before this run's first iteration {resumed_at + 1} (resumed): nothing is profiled"
    if p.use_pytorch_profiler:
        return (f"profile: torch.profiler records {which} (record_shapes, with_stack); each rank writes its trace to "
                f"{cfg.logging.tensorboard_dir} (a line names it)")
    if device.type != "cuda":
        return (f"profile: {which} are marked for nsys (cudaProfilerStart/Stop, NVTX ranges): on {device.type} there is "
                "nothing for nsys to capture, training runs unprofiled (--use-pytorch-profiler records a torch.profiler trace)")
    return (f"profile: {which}: cudaProfilerStart before the first, cudaProfilerStop after the last, NVTX ranges "
            "(emit_nvtx) in between; capture them with nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop")


class TorchTrace:
    """This rank's ``--profile``: :meth:`step` before each training iteration, :meth:`close` after the last (or an
    error). Off without a config, without ``--profile``, on a rank not in ``--profile-ranks``, where the resumed run
    starts after the profiled iterations, and (nsys, which needs CUDA) on a CPU."""

    def __init__(self, cfg: TrainingConfig | None = None, runtime: Runtime | None = None, resumed_at: int = 0) -> None:
        self.mode: str | None = None  # "torch" (torch.profiler), "nsys" (cudaProfilerStart/Stop), None: off
        self.prof: torch.profiler.profile | None = None
        self.nvtx = None  # the emit_nvtx context while nsys captures
        self.iteration = resumed_at  # the last iteration stepped into
        if cfg is None or runtime is None or not cfg.profile.enabled or runtime.rank not in cfg.profile.ranks:
            return
        self.rank, self.start, self.end = runtime.rank, cfg.profile.step_start, cfg.profile.step_end
        self.first = max(self.start, resumed_at + 1)  # the first profiled iteration this run trains
        schedule = trace_schedule(self.start, self.end, resumed_at)
        if schedule is None:
            return
        if cfg.profile.use_pytorch_profiler:
            self.mode, self.trace_dir, self.started = "torch", cfg.logging.tensorboard_dir, False
            wait, warmup, active = schedule
            activities = [torch.profiler.ProfilerActivity.CPU]
            activities += [torch.profiler.ProfilerActivity.CUDA] if runtime.device.type == "cuda" else []
            self.prof = torch.profiler.profile(
                activities=activities, schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                on_trace_ready=self._trace_ready, record_shapes=True, with_stack=True,
            )
        elif runtime.device.type == "cuda":
            self.mode = "nsys"

    def step(self, iteration: int) -> None:
        """Before training ``iteration`` (as the log counts it)."""
        if self.mode == "torch":
            if not self.started:
                self.prof.start()  # step 0: the profiler's schedule counts from here
                self.started = True
            self.prof.step()  # may write the trace of the iterations before this one
        elif self.mode == "nsys":
            if self.nvtx is not None and iteration >= self.end:
                self._stop_capture()
            if self.nvtx is None and self.start <= iteration < self.end:
                self._start_capture()
        self.iteration = iteration

    def close(self) -> None:
        """End a recording still running (its trace written: the run ended inside the profiled iterations)."""
        if self.mode == "torch" and self.started:
            self.prof.stop()
        if self.nvtx is not None:
            self._stop_capture()
        self.mode = None

    def _start_capture(self) -> None:
        torch.cuda.cudart().cudaProfilerStart()
        self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
        self.nvtx.__enter__()

    def _stop_capture(self) -> None:
        self.nvtx.__exit__(None, None, None)
        self.nvtx = None
        torch.cuda.cudart().cudaProfilerStop()

    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        """torch.profiler's ``on_trace_ready``: Megatron-LM's ``tensorboard_trace_handler`` writes the trace, then one
        line names its file: this process's (the handler's worker name, torch's own ``HOST_PID``), never another rank's
        file written into the same directory at the same time (its ``.tmp`` before the rename, seen under load)."""
        worker = f"{socket.gethostname()}_{os.getpid()}"
        before = set(os.listdir(self.trace_dir)) if os.path.isdir(self.trace_dir) else set()
        torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name=worker)(prof)
        written = sorted(f for f in set(os.listdir(self.trace_dir)) - before if trace_of(worker, f))
        path = os.path.join(self.trace_dir, written[-1]) if written else self.trace_dir
        print(f" profile: rank {self.rank} wrote the torch.profiler trace of iterations {self.first} to "
              f"{min(self.end - 1, self.iteration)} to {path}", flush=True)


def trace_of(worker: str, name: str) -> bool:
    """Whether ``name`` is a finished trace of ``worker`` (``tensorboard_trace_handler``'s ``WORKER.TIME.pt.trace.json``,
    optionally gzipped; not another worker's, nor a file still being written)."""
    return name.startswith(worker + ".") and name.endswith((".pt.trace.json", ".pt.trace.json.gz"))
