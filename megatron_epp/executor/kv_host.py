"""Split sequences' K/V buffers in host memory (the plan's ``Pipeline.kv_host``; FPDT's pattern; docs/training.md,
"Activation offload").

For a sequence on the host, each layer's K/V buffer (all its rows) and its gradient accumulators live in host buffers
of the model's :class:`~megatron_epp.executor.offload.HostPool` (:class:`HostKVLayer`: pinned on CUDA; plain on CPU,
poisoned with NaN when acquired, so a row read before it was written, or a gradient never accumulated, changes the
gradients). The device holds one :class:`KVWindow` per sequence, from its first slice's forward to that slice's
backward, shared by all its layers and slices: :data:`WINDOW` slots of the largest slice's K/V (the block in use and
the block being fetched) and as many slots of their gradients, what the memory walk counts (``simulator/memory.py``
``KV_WINDOW``). The blocks are the sequence's slices (``ChunkView.kv_blocks``): a slice's attention runs block by
block over its prefix and then its own rows, merged by the log-sum-exp (``kernels.merged_forward``; on CPU the same
arithmetic as the device buffer's ``sdpa-merged`` path, so the gradients are the same bit for bit; on CUDA each block
through torch's aten flash ops, ``kernels.BlockFlashKernel``, equal to the device buffer's varlen run within rounding).

Forward of slice ``j`` on a layer (:meth:`SliceIO.forward_parts`): prefix block ``i`` is fetched into slot ``i % 2``
while block ``i - 1`` is computed; its own K/V are copied into their slot and written out to the host rows ``[C, C +
s)`` (once: a recompute finds them written). Backward (:meth:`SliceIO.backward_parts`, the mirror): every block
(prefix and own) fetched again ahead of use, with the accumulated gradient rows where later slices left some; a
prefix block's K/V gradients are added into its accumulator slot and written back to the host; the own block's are
its own rows' plus what later slices accumulated for them. The first slice's backward releases the layer's host
buffers, and with the last of its layers the window.

CUDA: every copy on the offload's side stream; a copy into or out of a slot waits for the default stream's last use of
that slot (an event), and the default stream waits for the copy's event before it reads the slot; host buffers go
back to the pool with the event of their last copy. Nothing synchronises the default stream. CPU: the same path, the
copies real and synchronous.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from megatron_epp.executor.offload import ActivationOffload

WINDOW = 2  # slots per window: the block in use and the block being fetched (the walk's KV_WINDOW)
# test-only faults (KVHost.fault): a prefix block fetched from rows shifted by one; a slice's own K/V never written to
# the host; prefix gradients never written back to the host accumulator
FAULTS = ("kv-wrong-rows", "kv-skip-write", "kv-skip-accumulate")


def _rows_like(pool, rows: int, like: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A host buffer of the pool and its ``[rows, *like.shape[1:]]`` view in ``like``'s dtype (NaN on CPU)."""
    shape = (rows, *like.shape[1:])
    nbytes = rows * like[0].numel() * like.element_size()
    raw = pool.acquire(nbytes, grad=grad)
    typed = raw.view(like.dtype).view(shape)
    if not pool.pin and like.is_floating_point():
        typed.fill_(float("nan"))
    return raw, typed


class HostKVLayer:
    """One layer's K/V rows of a sequence on the host (``key``, ``value``: ``[seq_length, b, kv_heads, d]``) and their
    gradient accumulators (``grads``); ``written``: rows holding K/V; ``accumulated``: rows holding gradients."""

    def __init__(self, pool, length: int, like: torch.Tensor) -> None:
        self.pool = pool
        (kr, self.key), (vr, self.value) = (_rows_like(pool, length, like, False) for _ in range(2))
        (gkr, gk), (gvr, gv) = (_rows_like(pool, length, like, True) for _ in range(2))
        self.grads = (gk, gv)
        self.raw = [(kr, False), (vr, False), (gkr, True), (gvr, True)]
        self.written = self.accumulated = 0
        self.event: Any = None  # the last copy that touched these buffers (CUDA)

    def release(self) -> None:
        for raw, grad in self.raw:
            self.pool.release(raw, self.event, grad=grad)
        self.raw = []


class KVWindow:
    """A sequence's device window: :data:`WINDOW` slots of K/V (``kv``) and of their gradients (``grads``), each
    ``[rows, b, kv_heads, d]``; per slot the default stream's last use (``used``) and the side stream's last copy
    (``copied``) as events (CUDA; None on CPU)."""

    def __init__(self, rows: int, like: torch.Tensor) -> None:
        shape = (rows, *like.shape[1:])

        def slot() -> tuple[torch.Tensor, torch.Tensor]:
            return torch.empty(shape, dtype=like.dtype, device=like.device), torch.empty(shape, dtype=like.dtype, device=like.device)

        self.kv = [slot() for _ in range(WINDOW)]
        self.grads = [slot() for _ in range(WINDOW)]
        self.used: dict[tuple[str, int], Any] = {}
        self.copied: dict[tuple[str, int], Any] = {}

    def storages(self, grads: bool) -> list[torch.UntypedStorage]:
        return [t.untyped_storage() for pair in (self.grads if grads else self.kv) for t in pair]


class KVHost:
    """One model's K/V buffers on the host (held by its ``ChunkContext``): per sequence its window and its layers'
    host buffers; the copies go through ``offload`` (its pool and, on CUDA, its side stream). ``on_change`` is told
    when a window is allocated or released (memory tracking); ``fault``: test-only, one of :data:`FAULTS`."""

    def __init__(self, offload: ActivationOffload, on_change: Callable[[], None]) -> None:
        self.offload, self.on_change = offload, on_change
        self.windows: dict[int, KVWindow] = {}
        self.layers: dict[tuple[int, int], HostKVLayer] = {}
        self.fault: str | None = None

    def layer(self, seq: int, layer: int, length: int, rows: int, like: torch.Tensor) -> tuple[KVWindow, HostKVLayer]:
        """``seq``'s window (``rows`` per slot) and its host buffers on ``layer`` (``length`` rows), allocated by the first call."""
        if seq not in self.windows:
            self.windows[seq] = KVWindow(rows, like)
            self.on_change()
        store = self.layers.get((seq, layer))
        if store is None:
            store = self.layers[seq, layer] = HostKVLayer(self.offload.pool, length, like)
        return self.windows[seq], store

    def release(self, seq: int, layer: int) -> None:
        """The first slice's backward on ``layer`` is over: its host buffers go back; with the last layer, the window."""
        store = self.layers.pop((seq, layer), None)
        if store is not None:
            store.release()
        if seq in self.windows and not any(s == seq for s, _ in self.layers):
            del self.windows[seq]
            self.on_change()

    def clear(self) -> None:
        for store in self.layers.values():
            store.release()
        self.layers.clear()
        self.windows.clear()

    def storages(self, grads: bool = False) -> list[torch.UntypedStorage]:
        """The device storages of every window: K/V slots, or (``grads``) their gradient slots."""
        return [st for window in self.windows.values() for st in window.storages(grads)]

    # copies: host rows <-> a window slot, ordered by the slot's events (module docstring)
    def copy(self, window: KVWindow, key: tuple[str, int], dst: torch.Tensor, src: torch.Tensor, store: HostKVLayer) -> None:
        """``dst.copy_(src)`` between a slot (``window``'s ``key``) and host rows of ``store``: on the side stream after
        the default stream's last use of the slot (CUDA), synchronous on CPU."""
        off = self.offload
        if not off.cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(off.stream):
            if window.used.get(key) is not None:
                off.stream.wait_event(window.used[key])
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(off.stream)
        window.copied[key] = store.event = event

    def use(self, window: KVWindow, key: tuple[str, int]) -> None:
        """The default stream is about to read or write slot ``key``: it waits for the slot's last copy (CUDA)."""
        event = window.copied.get(key)
        if event is not None:
            torch.cuda.current_stream(self.offload.device).wait_event(event)

    def used(self, window: KVWindow, key: tuple[str, int]) -> None:
        """The default stream's work on slot ``key`` is queued: a later copy into or out of it waits for it (CUDA)."""
        if self.offload.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.offload.device))
            window.used[key] = event


class SliceIO:
    """One slice's K/V on one layer for the attention (``_HostSliceAttention``): ``blocks`` are the sequence's slices
    ``[start, end)`` up to this one (its prefix blocks, then its own); ``first``: the sequence's first slice (its
    backward releases the layer's host buffers)."""

    def __init__(self, host: KVHost, seq: int, layer: int, window: KVWindow, store: HostKVLayer,
                 blocks: list[tuple[int, int]]) -> None:
        self.host, self.seq, self.layer, self.window, self.store = host, seq, layer, window, store
        self.blocks = blocks
        self.own_grads: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def own(self) -> int:
        return len(self.blocks) - 1

    def _fetch(self, i: int, grads: bool = False) -> None:
        """Block ``i``'s host rows (K/V, or its accumulated gradients) into slot ``i % WINDOW``."""
        a, b = self.blocks[i]
        if self.host.fault == "kv-wrong-rows" and i < self.own and not grads:
            shift = -1 if a > 0 else 1  # one row earlier (the first block: one later, still within the written prefix)
            a, b = a + shift, b + shift
        slot = (self.window.grads if grads else self.window.kv)[i % WINDOW]
        src = self.store.grads if grads else (self.store.key, self.store.value)
        for dst, rows in zip(slot, src):
            self.host.copy(self.window, ("g" if grads else "kv", i % WINDOW), dst[: b - a], rows[a:b], self.store)

    def _slot(self, i: int, grads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``i``'s rows in its slot, the default stream ordered after their copy."""
        key = ("g" if grads else "kv", i % WINDOW)
        self.host.use(self.window, key)
        rows = self.blocks[i][1] - self.blocks[i][0]
        return tuple(t[:rows] for t in (self.window.grads if grads else self.window.kv)[i % WINDOW])

    def forward_parts(self, key: torch.Tensor, value: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
        """``(k, v, causal)`` per block (``[b, kv_heads, rows, d]``), prefix blocks fetched one ahead, then the own rows
        ``key``/``value`` (``[s, b, kv_heads, d]``) through their slot, written out to the host."""
        if self.own:
            self._fetch(0)
        for i in range(len(self.blocks)):
            if i + 1 < self.own:
                self._fetch(i + 1)
            k, v = self._slot(i)
            if i == self.own:
                with torch.no_grad():
                    k.copy_(key)
                    v.copy_(value)
            yield k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), i == self.own
            self.host.used(self.window, ("kv", i % WINDOW))
        a, b = self.blocks[self.own]
        if b > self.store.written and self.host.fault != "kv-skip-write":
            k, v = self._slot(self.own)
            self.host.copy(self.window, ("kv", self.own % WINDOW), self.store.key[a:b], k, self.store)
            self.host.copy(self.window, ("kv", self.own % WINDOW), self.store.value[a:b], v, self.store)
        self.store.written = max(self.store.written, b)

    def backward_parts(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
        """``(k, v, causal)`` per block, each fetched one ahead with its accumulated gradients (where there are)."""
        self._prefetch(0)
        for i in range(len(self.blocks)):
            if i + 1 < len(self.blocks):
                self._prefetch(i + 1)
            k, v = self._slot(i)
            yield k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), i == self.own
            self.host.used(self.window, ("kv", i % WINDOW))

    def _prefetch(self, i: int) -> None:
        self._fetch(i)
        if self.store.accumulated >= self.blocks[i][1]:
            self._fetch(i, grads=True)

    def take_grads(self, i: int, grad_key: torch.Tensor, grad_value: torch.Tensor) -> None:
        """Block ``i``'s K/V gradients (``[b, kv_heads, rows, d]``): a prefix block's added into its accumulator and
        written back; the own block's, plus what later slices accumulated for it, kept (``own_grads``)."""
        grads = (grad_key.permute(2, 0, 1, 3), grad_value.permute(2, 0, 1, 3))
        accumulated = self.store.accumulated >= self.blocks[i][1]
        key = ("g", i % WINDOW)
        if i == self.own:
            self.own_grads = tuple(g + s for g, s in zip(grads, self._slot(i, grads=True))) if accumulated else grads
            self.host.used(self.window, key)
            return
        slots = self._slot(i, grads=True)
        with torch.no_grad():
            for slot, grad in zip(slots, grads):
                if not accumulated:
                    slot.zero_()
                slot += grad
        self.host.used(self.window, key)
        if self.host.fault != "kv-skip-accumulate":
            a, b = self.blocks[i]
            for rows, slot in zip(self.store.grads, slots):
                self.host.copy(self.window, key, rows[a:b], slot, self.store)

    def finish_backward(self) -> None:
        """After the backward: the prefix rows hold gradients now; the first slice releases the layer's buffers."""
        self.store.accumulated = max(self.store.accumulated, self.blocks[self.own][0])
        if self.own == 0:
            self.host.release(self.seq, self.layer)
