"""Activation offload in the executor: a chunk's recompute checkpoints (layer inputs) in host memory between its
forward and its backward, as the plan says (``Pipeline.offload``; docs/training.md, "Activation offload").

Per (stage, chunk) the plan checkpoints the stage's first ``c`` layers (``ChunkView.recompute``) and of those the
first ``o`` (``ChunkView.offload``) keep their checkpoint on the host. :class:`ChunkRecomputeLayer` runs such a layer's
checkpoint under :meth:`ActivationOffload.hooks` (``torch.autograd.graph.saved_tensors_hooks``): the checkpoint
saves only its input, whose storage is copied into a host buffer of :class:`HostPool` and then released on the device
(``resize_(0)``: also where another owner holds the tensor, as the schedule holds a received input); it comes back into
the same tensor (its storage resized and filled) before that layer's recompute. Prefetch: when a checkpointed layer's
backward begins (its checkpoint is unpacked) the next offloaded checkpoint below it is fetched, so its copy runs
behind this layer's recompute and backward; the chunk's first fetch (at ``o = c``: the last checkpointed layer's own
input) is made when it is needed. On the device at the first recompute of the chunk: the recomputed layer's
activations, the checkpoints kept, and one fetched input ahead where an offloaded one is left below it (what the memory
walk counts: ``simulator/memory.py``).

CUDA: copies on a side stream (out: after the producing work of the default stream, the device storage released
once the copy is queued, ``record_stream`` keeping the allocator from reusing it before the copy ends; in: after
the work the default stream has queued, the default stream waiting on the copy's event before the recompute);
pinned host buffers, reused by size; nothing synchronises the default stream. CPU: the same path with plain host
buffers (the copy is real, into separate storage), the released storage first poisoned with NaN, so a reload that
is skipped or reads the wrong buffer changes the gradients. The CPU activation memory tracker
(:class:`~megatron_epp.executor.memory_tracker.ActivationMemoryTracker`) counts a checkpoint on the host as off the
device and a fetched one from its fetch (``track``); the pool's in-use peak is the host's (``HostPool.peak_bytes``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# test-only faults (ActivationOffload.fault): reload from another checkpoint's host buffer; skip the reload's copy
FAULTS = ("wrong-slot", "skip-reload")


class HostPool:
    """Host buffers (``uint8``) reused by byte size: pinned where the device is CUDA. ``in_use_bytes`` /
    ``peak_bytes``: what the offloaded checkpoints and the K/V buffers on the host (:mod:`.kv_host`) hold now / at most
    since :meth:`reset_peak`; ``grad_bytes`` / ``peak_with_grads``: the K/V gradient accumulators on the host now / the
    most of both together (what the memory walk counts where ``kv_grad`` is 1); ``reserved_bytes``: every buffer the
    pool holds, free or not."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.free: dict[int, list[tuple[torch.Tensor, Any]]] = {}  # bytes -> (buffer, the event of its last copy)
        self.in_use_bytes = self.peak_bytes = self.reserved_bytes = 0
        self.grad_bytes = self.peak_with_grads = 0

    def acquire(self, nbytes: int, grad: bool = False) -> torch.Tensor:
        free = self.free.get(nbytes)
        if free:
            buffer, event = free.pop()
            if event is not None:
                event.synchronize()  # the copy that read it ended (the side stream's, never the default stream's)
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self.reserved_bytes += nbytes
        if grad:
            self.grad_bytes += nbytes
        else:
            self.in_use_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        self.peak_with_grads = max(self.peak_with_grads, self.in_use_bytes + self.grad_bytes)
        return buffer

    def release(self, buffer: torch.Tensor, event: Any = None, grad: bool = False) -> None:
        """``buffer`` free again once ``event`` (the copy that reads it; None: none pending) has completed."""
        if grad:
            self.grad_bytes -= buffer.numel()
        else:
            self.in_use_bytes -= buffer.numel()
        self.free.setdefault(buffer.numel(), []).append((buffer, event))

    def reset_peak(self) -> None:
        self.peak_bytes = self.in_use_bytes
        self.peak_with_grads = self.in_use_bytes + self.grad_bytes


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole of ``storage`` as a ``uint8`` tensor (a checkpoint's storage moves whole, views and all)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Passed:
    """Something else saved under the hooks: as it is (and counted as the tracker counts a saved tensor)."""

    __slots__ = ("tensor", "hold")

    def __init__(self, tensor: torch.Tensor, hold: Any) -> None:
        self.tensor, self.hold = tensor, hold

    def unpack(self, offload: "ActivationOffload") -> torch.Tensor:
        return self.tensor


class _Kept:
    """A checkpoint that stays on the device, in a chunk that offloads others: its unpack starts the next fetch."""

    __slots__ = ("tensor", "hold", "chunk", "index")

    def __init__(self, offload: "ActivationOffload", tensor: torch.Tensor, chunk: list, index: int) -> None:
        self.tensor, self.chunk, self.index = tensor, chunk, index
        self.hold = offload.track(tensor)  # the tracker counts it as it counts any saved tensor

    def unpack(self, offload: "ActivationOffload") -> torch.Tensor:
        offload.prefetch_below(self.chunk, self.index)
        self.chunk[self.index] = None
        return self.tensor


class _Offloaded:
    """A checkpoint on the host: its tensor (storage released), the host buffer, the copy's event (CUDA)."""

    __slots__ = ("tensor", "nbytes", "host", "event", "loaded", "hold", "chunk", "index", "pool", "__weakref__")

    def __init__(self, offload: "ActivationOffload", tensor: torch.Tensor, chunk: list, index: int) -> None:
        self.tensor, self.chunk, self.index, self.pool = tensor, chunk, index, offload.pool
        storage = tensor.untyped_storage()
        self.nbytes = storage.nbytes()
        self.host = offload.pool.acquire(self.nbytes)
        self.event, self.loaded, self.hold = offload.copy_out(storage, self.host), False, None

    def load(self, offload: "ActivationOffload", source: torch.Tensor | None = None) -> None:
        """Bring the checkpoint back into its tensor (from ``source``, a host buffer, under the wrong-slot fault)."""
        if self.loaded:
            return
        storage = self.tensor.untyped_storage()
        storage.resize_(self.nbytes)
        event = offload.copy_in(self.host if source is None else source, storage, self.event)
        self.pool.release(self.host, event)
        self.host, self.event, self.loaded = None, event, True
        self.hold = offload.track(self.tensor)

    def unpack(self, offload: "ActivationOffload") -> torch.Tensor:
        if not self.loaded:
            self.load(offload, offload.wrong_source(self.chunk, self.index))
        offload.wait(self.event)
        offload.prefetch_below(self.chunk, self.index)
        self.chunk[self.index] = None
        return self.tensor

    def __del__(self) -> None:
        if self.host is not None:  # never brought back (a step that failed): its buffer goes back to the pool
            self.pool.release(self.host, self.event)


class _CheckpointHooks(torch.autograd.graph.saved_tensors_hooks):
    """The hooks of one checkpoint; ``armed`` once the checkpointed layer's forward has run (set by the layer)."""

    def __init__(self, pack, unpack) -> None:
        super().__init__(pack, unpack)
        self.armed = False


class ActivationOffload:
    """One model's offload (held by its :class:`~megatron_epp.executor.context.ChunkContext`): the host pool, the side
    stream (CUDA), ``track`` (what counts a checkpoint on the device: the CPU tracker's, while one measures) and
    ``fault`` (test-only, one of :data:`FAULTS`)."""

    def __init__(self, device: torch.device, track: Callable[[torch.Tensor], Any]) -> None:
        self.device, self.track = device, track
        self.cuda = device.type == "cuda"
        self.pool = HostPool(pin=self.cuda)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.fault: str | None = None

    def hooks(self, chunk: list, index: int, offloaded: bool, checkpoint: torch.Tensor) -> "_CheckpointHooks":
        """Saved-tensor hooks around the checkpoint of local layer ``index`` of a chunk (``chunk``: its handles by local
        layer, shared by its layers) whose input is ``checkpoint``: that input to the host where ``offloaded``, else
        kept (and counted) on the device, once the layer's own run is over (``armed``: the checkpoint saves its input
        after it); anything else saved meanwhile (torch's dropout saves under ``no_grad``) is passed through as the
        tracker would hold it."""
        kind = _Offloaded if offloaded else _Kept
        key = checkpoint.untyped_storage().data_ptr()
        hooks: _CheckpointHooks

        def pack(tensor: torch.Tensor):
            if (not hooks.armed or isinstance(tensor, torch.nn.Parameter) or tensor.untyped_storage().data_ptr() != key
                    or chunk[index] is not None):
                return _Passed(tensor, self.track(tensor))
            handle = chunk[index] = kind(self, tensor, chunk, index)
            return handle

        def unpack(handle):
            return handle.unpack(self)

        hooks = _CheckpointHooks(pack, unpack)
        return hooks

    def copy_out(self, storage: torch.UntypedStorage, host: torch.Tensor):
        """Copy ``storage`` into ``host`` and release it on the device; the copy's event (CUDA) or None."""
        device = _bytes(storage)
        if not self.cuda:
            host.copy_(device)
            if storage.nbytes() % 4 == 0:  # poisoned: a reload that reads nothing back reads NaN, never stale bytes
                device.view(torch.float32).fill_(float("nan"))
            storage.resize_(0)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the checkpoint is written
        with torch.cuda.stream(self.stream):
            host.copy_(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        device.record_stream(self.stream)  # the allocator reuses the storage only after the copy
        storage.resize_(0)
        return event

    def copy_in(self, host: torch.Tensor, storage: torch.UntypedStorage, after: Any):
        """Copy ``host`` into ``storage`` (just resized); the copy's event (CUDA) or None."""
        device = _bytes(storage)
        if self.fault == "skip-reload":
            return None
        if not self.cuda:
            device.copy_(host)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the storage's block is free of earlier work
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            device.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        device.record_stream(self.stream)
        return event

    def wait(self, event: Any) -> None:
        """The default stream waits for ``event`` (a fetch) before the recompute reads the checkpoint (no host sync)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def prefetch_below(self, chunk: list, index: int) -> None:
        """Start fetching the next offloaded checkpoint of ``chunk`` below local layer ``index`` (the next one its
        backward needs), if there is one not yet fetched."""
        for handle in reversed(chunk[:index]):
            if isinstance(handle, _Offloaded):
                handle.load(self, self.wrong_source(chunk, handle.index))
                return

    def wrong_source(self, chunk: list, index: int) -> torch.Tensor | None:
        """Under the wrong-slot fault, another offloaded checkpoint's host buffer of the same size; else None."""
        if self.fault != "wrong-slot":
            return None
        mine = chunk[index]
        return next((h.host for h in chunk if isinstance(h, _Offloaded) and h is not mine and h.host is not None
                     and h.nbytes == mine.nbytes), None)
