"""Measured peak activation memory of one stage during a step, on any device.

CUDA: the caching allocator's cache is emptied as the step begins (``empty_cache``: what it reserves is then what it
has allocated, model states and inputs), its statistics reset, and its peaks above what was allocated when the
step began are read (the model states as they are: weights, gradient buffers, and from the first optimizer step on the
optimizer's states; and the step's inputs): ``peak_allocated`` from ``max_memory_allocated``, and ``peak_bytes``
from ``max_memory_reserved``, what the allocator held from the device, which is what runs out (a request the
allocator cannot serve from its reserved blocks asks the device for more; fragmentation across the steps' varied
chunk shapes makes reserved exceed allocated). The planner's activation count compares with ``peak_bytes`` and
its model states (the cost model's count) add to it to make the step's peak against the budget; the planner
calibrates its memory model on it (``planner.calibration.fit_memory_factor``). The peaks are read also when the
step raises (an out-of-memory error: the peaks up to the failure). Why empty the cache: without it the reserved peak
holds what earlier steps left cached (the optimizer step's temporaries, other chunk shapes), a step's own need is not
seen, and a calibration on it runs away (measured on an H200, 2026-11-27, 40 layers of hidden 2048 at a 32K cap:
reserved 102 GB above the step's start on every step from the 3rd on while 53-85 GB were allocated, the activation
memory factor growing 1.2 -> 1.92 in 8 steps, and the first step after the first optimizer step ran out of memory
with 97 GB of activations allocated and 9.3 GiB reserved but unallocated; emptied each step, the same run reserved
0.6-4.1 GiB above its allocated peak, ran no step out of memory, and its time outside the schedule was unchanged:
median 197 against 204 ms an iteration, docs/measurements/2026-11-27-h200). CPU (no allocator statistics): the tensors autograd saves for backward, deduplicated by storage and followed until
autograd frees them (``saved_tensors_hooks``), plus the split sequences' K/V buffers (from their
allocation by a first slice to their release by its backward); parameters are model states and are
not counted, nor are gradients. ``peak_with_kv_grads`` (CPU) adds the split sequences' K/V gradient
accumulators, which CUDA's allocator peak includes (the planner counts them where ``kv_grad`` is 1):
what a test checks that count against. Activation offload (:mod:`.offload`): a checkpoint in host memory is off the
device (its saved-tensor hooks, not these, see it go), counted again from its fetch back (``ChunkContext.tracker``);
``peak_host_bytes`` is the host pool's peak over the step (CPU and CUDA).
"""

from __future__ import annotations

import torch

from megatron_epp.executor.context import ChunkContext


class _Saved:
    """Holds one saved tensor for autograd; tells the tracker when autograd lets go of it."""

    __slots__ = ("tensor", "tracker", "key")

    def __init__(self, tensor: torch.Tensor, tracker: "ActivationMemoryTracker", key: int) -> None:
        self.tensor, self.tracker, self.key = tensor, tracker, key

    def __del__(self) -> None:
        self.tracker._release(self.key)


class ActivationMemoryTracker:
    """``with ActivationMemoryTracker(device, context) as t: step()`` then ``t.peak_bytes``.

    ``context`` is the chunk context whose K/V buffers count. On CPU each saved tensor costs O(1):
    the buffers are re-listed only when one is allocated or released (``context.kv_version``), and
    their bytes not already counted as saved are kept up to date as storages enter and leave the
    saved set.
    """

    def __init__(self, device: torch.device, context: ChunkContext | None) -> None:
        self.device, self.context = device, context  # None: on CUDA, the allocator's figures alone
        self.peak_bytes = 0
        self.peak_with_kv_grads = 0
        self.peak_allocated = 0  # CUDA: the allocated peak (peak_bytes is the reserved one); CPU: peak_bytes
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self._current = 0
        self._hooks = None
        self._start = 0
        self._kv_version = -1
        self._kv: dict[int, int] = {}  # K/V buffers: storage pointer -> bytes
        self._kv_unsaved = 0  # bytes of K/V buffer storages that are not in ``_live``
        self._kv_grads = 0  # bytes of their gradient accumulators
        self.peak_host_bytes = 0  # activation offload: the most the host pool held (checkpoints, K/V buffers on the host)
        self.peak_host_with_grads = 0  # and with the K/V gradient accumulators on the host

    def _offload(self):
        """The model's activation offload (None: none, or no context: a CUDA step measured by the allocator alone)."""
        return None if self.context is None else self.context.offload

    def __enter__(self) -> "ActivationMemoryTracker":
        if self._offload() is not None:
            self._offload().pool.reset_peak()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the step's reserved peak is its own (see the module's doc)
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved.tensor)
            self._hooks.__enter__()
            self.context.tracker = self  # the offload's checkpoints on the device are counted here too
        return self

    def __exit__(self, *exc: object) -> None:
        if self._offload() is not None:
            self.peak_host_bytes = self._offload().pool.peak_bytes
            self.peak_host_with_grads = self._offload().pool.peak_with_grads
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self.context.tracker = None
            self.peak_allocated = self.peak_bytes
        else:
            torch.cuda.synchronize()
            self.peak_allocated = torch.cuda.max_memory_allocated() - self._start
            self.peak_bytes = self.peak_with_kv_grads = torch.cuda.max_memory_reserved() - self._start

    @property
    def held_bytes(self) -> int:
        """CPU: the bytes held now (the saved tensors autograd still holds, and the K/V buffers), where
        ``peak_bytes`` is the most held so far."""
        return self._current + self._kv_unsaved

    def _pack(self, tensor: torch.Tensor):
        if isinstance(tensor, torch.nn.Parameter):
            return _Plain(tensor)
        if self._kv_version != self.context.kv_version:
            self._kv_version = self.context.kv_version
            self._kv = self.context.kv_storages()
            self._kv_unsaved = sum(nbytes for ptr, nbytes in self._kv.items() if ptr not in self._live)
            self._kv_grads = self.context.kv_gradient_bytes()
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [storage.nbytes(), 0]
            self._current += entry[0]
            self._kv_unsaved -= self._kv.get(key, 0)
        entry[1] += 1
        self.peak_bytes = max(self.peak_bytes, self._current + self._kv_unsaved)
        self.peak_with_kv_grads = max(self.peak_with_kv_grads, self._current + self._kv_unsaved + self._kv_grads)
        return _Saved(tensor, self, key)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self._current -= entry[0]
            del self._live[key]
            self._kv_unsaved += self._kv.get(key, 0)


class _Plain:
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
