"""The copy bandwidth between the device and host memory, measured once at start-up for the planner's host link
(issue 41 item 4; docs/training.md, "Activation offload"; docs/planner.md, "Activation offload").

:func:`measure_copy_bandwidth` times what the executor's offload does (``executor/offload.py``): on CUDA a device to
pinned host copy and a pinned host to device copy of a few hundred MB, on two streams at once (one copy engine per
direction), timed with CUDA events; on CPU, where the executor copies a checkpoint host to host into its pool and back
in the training thread, the same two copies between host buffers (``torch.Tensor.copy_``), one after the other. Each
figure is the median over a few repeats, within a time box. :func:`measure_node_copy_bandwidth` runs it on every rank
at the same moment (the node's ranks share PCIe and the NUMA node's memory), the ranks agreeing after each repeat
whether to go on, and takes the minimum over the ranks, so every rank plans on the same link.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

MIB = 1 << 20
CUDA_COPY_BYTES = 256 * MIB  # per direction and repeat on CUDA (a few hundred MB: past the PCIe link's ramp-up)
CPU_COPY_BYTES = 64 * MIB  # per direction and repeat on CPU (past the last-level cache)
REPEATS = 5  # timed repeats (after one untimed warm-up), fewer where the time box ends first
TIME_BOX_S = 2.0  # no repeat starts after this many seconds of measuring


@dataclass(frozen=True)
class CopyBandwidth:
    """One rank's (or the minimum over ranks') copy bandwidth in bytes per ms: ``d2h`` device to host (on CPU: out to
    the pool), ``h2d`` host to device (back); ``repeats`` timed, of ``nbytes`` each, on ``device_type``; ``ranks``
    copying at once."""

    d2h_bytes_per_ms: float
    h2d_bytes_per_ms: float
    nbytes: int
    repeats: int
    device_type: str
    ranks: int = 1


def _cuda_repeat(buffers, streams) -> tuple[float, float]:
    """One repeat on CUDA: both copies at once on their own streams; their times in ms (CUDA events)."""
    device_src, host_dst, host_src, device_dst = buffers
    times = []
    for stream, dst, src in ((streams[0], host_dst, device_src), (streams[1], device_dst, host_src)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        times.append((start, end))
    torch.cuda.synchronize(device_src.device)
    return times[0][0].elapsed_time(times[0][1]), times[1][0].elapsed_time(times[1][1])


def _cpu_repeat(buffers) -> tuple[float, float]:
    """One repeat on CPU: out to the pool's buffer, then back; their times in ms (``perf_counter``)."""
    src, pool, back = buffers
    t0 = time.perf_counter()
    pool.copy_(src)
    t1 = time.perf_counter()
    back.copy_(pool)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = REPEATS,
                           time_box_s: float = TIME_BOX_S, go_on=None) -> CopyBandwidth:
    """This rank's copy bandwidth (see the module): ``nbytes`` per direction and repeat (default
    :data:`CUDA_COPY_BYTES` / :data:`CPU_COPY_BYTES`), one untimed warm-up, then up to ``repeats`` timed repeats,
    none started after ``time_box_s`` seconds; the median of each direction. ``go_on(more)`` (the ranks' agreement,
    :func:`measure_node_copy_bandwidth`) is called after each repeat with whether this rank would go on, and says
    whether to; its first call, with True, comes before the first timed repeat."""
    cuda = device.type == "cuda"
    nbytes = nbytes or (CUDA_COPY_BYTES if cuda else CPU_COPY_BYTES)
    go_on = go_on or (lambda more: more)
    if cuda:
        buffers = (torch.ones(nbytes, dtype=torch.uint8, device=device), torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
                   torch.ones(nbytes, dtype=torch.uint8, pin_memory=True), torch.empty(nbytes, dtype=torch.uint8, device=device))
        streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        torch.cuda.synchronize(device)  # the default stream's fill of the source before the side streams read it
        repeat = lambda: _cuda_repeat(buffers, streams)  # noqa: E731
    else:
        buffers = (torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8))
        repeat = lambda: _cpu_repeat(buffers)  # noqa: E731
    repeat()  # warm-up: first-touch page faults, the copy engines' and the allocator's first use
    d2h, h2d = [], []
    start = time.perf_counter()
    more = go_on(True)
    while more:
        out_ms, in_ms = repeat()
        d2h.append(max(out_ms, 1e-6))
        h2d.append(max(in_ms, 1e-6))
        more = go_on(len(d2h) < repeats and time.perf_counter() - start < time_box_s)
    if cuda:  # the buffers' device memory back, and the allocator's peak as it was before (the run's own from here)
        del buffers, repeat
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return CopyBandwidth(nbytes / statistics.median(d2h), nbytes / statistics.median(h2d), nbytes, len(d2h), device.type)


def measure_node_copy_bandwidth(device: torch.device, **kwargs) -> CopyBandwidth:
    """:func:`measure_copy_bandwidth` on every rank at once where ``torch.distributed`` is initialised (all ranks
    call it; each repeat starts together: an all-reduce of whether to go on, any rank's no ending it for all), the
    minimum of each direction over the ranks; else this process's. ``kwargs``: :func:`measure_copy_bandwidth`'s."""
    if not (dist.is_available() and dist.is_initialized()):
        return measure_copy_bandwidth(device, **kwargs)
    flag_device = device if dist.get_backend() == "nccl" else torch.device("cpu")

    def go_on(more: bool) -> bool:
        stop = torch.tensor([0.0 if more else 1.0], device=flag_device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        return stop.item() == 0.0

    mine = measure_copy_bandwidth(device, go_on=go_on, **kwargs)
    both = torch.tensor([mine.d2h_bytes_per_ms, mine.h2d_bytes_per_ms], dtype=torch.float64, device=flag_device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    return CopyBandwidth(float(both[0]), float(both[1]), mine.nbytes, mine.repeats, mine.device_type, dist.get_world_size())
