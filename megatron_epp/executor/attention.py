"""Core attention for elastic chunks: block-diagonal causal packing plus prefix K/V for slices.

Every segment attends causally to itself only (a packed chunk costs the sum of its segments'
squares, not the square of its length); the tokens of a slice (split chunk, or the tail of a hybrid
chunk) also attend to all K/V of the sequence's earlier slices, placed first in the key order
(bottom-right causal over its ``C + s`` keys). The slice's keys and values are rows ``[0, C + s)`` of
its sequence's K/V buffer on the layer (:class:`~megatron_epp.executor.context.KVBuffer`), where it
has written its own K/V: the prefix is read in place, never concatenated. The kernel is chosen once by
``EPP_ATTENTION_BACKEND`` (see :mod:`megatron_epp.executor.kernels`): on CPU every segment is one SDPA
with ``is_causal`` and the slice's prefix (block by block: its sequence's earlier slices) and own keys
calls merged by their log-sum-exp, no mask (what the CPU cost profiles fit; a sequence whose K/V buffer is on the
host, ``executor.kv_host``, runs the same blocks over its device window: ``_HostSliceAttention``); on CUDA the whole chunk is one varlen call (flash-attn's where it is
installed, else torch's own ``varlen_attn``: fp16/bf16, no attention dropout), else SDPA per segment
(``is_causal``, torch's lower-right causal bias for the slice) with cuDNN attention excluded.

Context parallelism (Ulysses, ``--context-parallel-size N``): each of a stage's N context-parallel ranks holds an
equal block of the chunk's tokens (``ChunkView.local_range``) for all its heads; megatron-core's all-to-all over the
context-parallel group (``all_to_all_sp2hp``) gives each rank every token of the chunk for ``heads / N`` heads, the
chunk's attention above runs on them unchanged (segments, the slice's prefix, the kernel), and the inverse all-to-all
(``all_to_all_hp2sp``) gives each rank its own tokens back with all heads. K/V heads are split the same way where N
divides them; otherwise each is first repeated (as the query heads that share it are spread over the ranks) to
``lcm(kv_heads, N)`` heads, so every rank holds the K/V heads its query heads read. A split slice's K/V buffer holds
this rank's K/V heads only.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import all_to_all_hp2sp, all_to_all_sp2hp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_epp.executor import kernels
from megatron_epp.executor.context import ChunkContext, ChunkView, KVBuffer
from megatron_epp.executor.kv_host import SliceIO


class _SliceKV(torch.autograd.Function):
    """A slice's keys and values ``[C + s, b, kv_heads, d]``: rows ``[0, C + s)`` of ``buffer``, after
    writing its own ``key``/``value`` (``[s, ...]``) at rows ``[C, C + s)``.

    Backward receives the gradients of all ``C + s`` rows: the prefix rows' go to the buffer's
    accumulator for the earlier slices; the own rows', plus what later slices accumulated for them
    (slices go backward last-to-first, so all of it is there), are the gradients of ``key``/``value``.
    The first slice, the last to run backward, then releases the buffer (``on_backward``). A recompute
    re-runs the forward (the write is a no-op, the first write wins) and only the recomputed graph is
    run backward, so nothing is counted twice.
    """

    @staticmethod
    def forward(ctx, key, value, buffer: KVBuffer, context: int, on_backward: Callable[[], None] | None):
        buffer.write(context, key, value)
        ctx.buffer, ctx.context, ctx.on_backward = buffer, context, on_backward
        return buffer.read(context + key.shape[0])

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        buffer, ctx.buffer = ctx.buffer, None  # the buffer's memory goes with its release, not with this graph
        grad_key, grad_value = buffer.gradients(ctx.context, grad_key, grad_value)
        if ctx.on_backward is not None:
            ctx.on_backward()
        return grad_key, grad_value, None, None, None


class _HostSliceAttention(torch.autograd.Function):
    """A slice's attention (``[b, heads, s, d]`` queries) over its K/V buffer on the host (:mod:`.kv_host`): its own
    ``key``/``value`` rows (``[s, b, kv_heads, d]``) written out, the prefix fetched block by block into the device
    window; :func:`kernels.merged_forward`, the arithmetic of the device buffer's ``sdpa-merged`` path on CPU
    (``kernel`` None: the CPU flash kernel), each block through ``kernel`` (:class:`kernels.BlockFlashKernel`, torch's
    aten flash ops) on CUDA. Saves the queries, the output and the log-sum-exp, never the K/V (the backward fetches
    them again); its backward gives the own rows' gradients, the prefix rows' accumulated on the host
    (``SliceIO.take_grads``)."""

    @staticmethod
    def forward(ctx, q, key, value, io: SliceIO, scale: float, kernel: kernels.BlockFlashKernel | None = None):
        out, lse = kernels.merged_forward(q, io.forward_parts(key, value), scale, kernel)
        ctx.save_for_backward(q, out, lse)
        ctx.io, ctx.scale, ctx.kernel = io, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, out, lse = ctx.saved_tensors
        io, ctx.io = ctx.io, None
        dq = kernels.merged_backward(grad_out.contiguous(), q, out, lse, io.backward_parts(), ctx.scale, io.take_grads, ctx.kernel)
        grad_key, grad_value = io.own_grads
        io.finish_backward()
        return dq, grad_key, grad_value, None, None, None


class ElasticAttention(MegatronModule):
    """Drop-in for ``SelfAttentionSubmodules.core_attention``: [s, b, heads, dim] in, [s, b, h] out.

    ``context`` (from the layer spec's ``params``) gives the current chunk and holds the K/V buffers;
    ``pg_collection`` (megatron-core's attention passes the model's) the context-parallel group of the all-to-all.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any = None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        *,
        context: ChunkContext,
    ) -> None:
        super().__init__(config=config)
        self.context = context
        self.layer_number = layer_number
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.deterministic = bool(getattr(config, "deterministic_mode", False))
        # --attention-backend (config.attention_backend), else EPP_ATTENTION_BACKEND, checked here
        self.backend_request = kernels.requested_backend(config.attention_backend.name)
        kernels.check_request(self.backend_request)
        # the layer's groups (megatron-core's attention passes its own); None, as megatron-core's attention: its defaults
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["cp"])
        self.cp_group = pg_collection.cp  # the all-to-all's group (Ulysses)
        self.cp_size = config.context_parallel_size
        if self.cp_size > 1 and (self.cp_group is None or self.cp_group.size() != self.cp_size):
            raise ValueError(f"ElasticAttention: context_parallel_size {self.cp_size} without its context-parallel group")

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("ElasticAttention takes its packing from the current chunk, not packed_seq_params/bias")
        if self.cp_size == 1:
            return self._attend(query, key, value)
        key, value = (replicate_kv_heads(t, self.cp_size) for t in (key, value))
        query, key, value = (tokens_to_heads(t, self.cp_group) for t in (query, key, value))
        out = self._attend(query, key, value)  # [s, b, heads / N * d]
        return heads_to_tokens(out, self.cp_group)

    def _attend(self, query, key, value):
        """The chunk's attention on every token of it: [s, b, heads, d] in, [s, b, heads * d] out."""
        view = self.context.view()
        dropout = self.dropout_p if self.training else 0.0
        if view.kv_host:
            return self._attend_host(view, query, key, value, dropout)
        slice_kv = self._slice_kv(view, key, value) if view.split_index is not None else None
        gqa = key.shape[2] != query.shape[2]
        backend = kernels.select_backend(self.backend_request, query.device, query.dtype, self.context.attention_backends, dropout, gqa=gqa,
                                         heads=(query.shape[2], key.shape[2], query.shape[3]), deterministic=self.deterministic)
        kwargs = {"deterministic": self.deterministic} if backend in kernels.DETERMINISTIC_BACKENDS else {}
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext():
            out = kernels.BACKENDS[backend](query, key, value, view, slice_kv, dropout, self.softmax_scale, **kwargs)
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _attend_host(self, view: ChunkView, query, key, value, dropout: float):
        """:meth:`_attend` where the slice's K/V buffer is on the host: every other segment SDPA's ``is_causal`` (as
        ``sdpa-merged``), the slice :class:`_HostSliceAttention` over the sequence's blocks up to it (its block kernel:
        :func:`kernels.block_kernel`, one line where there is none)."""
        if dropout > 0:
            raise ValueError("K/V buffers on the host (kv_host) run without attention dropout: the blocks are merged by their log-sum-exp")
        kernel = kernels.block_kernel(query.device, query.dtype)  # None on CPU: the CPU flash kernel
        seq, start, end = view.split_seq, *view.bounds[view.split_index]
        blocks = [*view.prefix_blocks, (view.context, view.context + end - start)]
        rows = max(b - a for a, b in view.kv_blocks) if view.kv_blocks else view.seq_length
        host = self.context.kv_host_store(query.device)
        window, store = host.layer(seq, self.layer_number, view.seq_length, rows, key)
        io = SliceIO(host, seq, self.layer_number, window, store, blocks)
        outputs = []
        for index, (a, b) in enumerate(view.bounds):
            if index != view.split_index:
                outputs.append(kernels.segment_attention(query[a:b], key[a:b], value[a:b], None, 0.0, self.softmax_scale, causal=True))
                continue
            q = query[a:b].permute(1, 2, 0, 3)
            out = _HostSliceAttention.apply(q, key[a:b], value[a:b], io, self.softmax_scale, kernel)
            outputs.append(out.permute(2, 0, 1, 3))
        out = torch.cat(outputs)
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _slice_kv(self, view: ChunkView, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slice's keys and values from its sequence's K/V buffer on this layer (allocated by the
        sequence's first slice, released by its backward), its own K/V written there first."""
        start, end = view.bounds[view.split_index]
        seq, layer = view.split_seq, self.layer_number
        buffer = self.context.kv_buffer(seq, layer, view.seq_length, key)
        release = (lambda: self.context.release(seq, layer)) if view.context == 0 else None
        return _SliceKV.apply(key[start:end], value[start:end], buffer, view.context, release)


def replicate_kv_heads(kv: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``kv`` ``[s, b, kv_heads, d]`` as :func:`tokens_to_heads` can split it over ``cp_size`` ranks: as it is where
    ``cp_size`` divides ``kv_heads``, else each K/V head repeated ``lcm(kv_heads, cp_size) / kv_heads`` times in place
    (the query heads that share it may be spread over several ranks; each then gets a copy, and autograd sums the
    copies' gradients). Query head ``i`` of ``heads`` still reads head ``i // (heads / heads')`` of the result."""
    kv_heads = kv.shape[2]
    if kv_heads % cp_size == 0:
        return kv
    return kv.repeat_interleave(math.lcm(kv_heads, cp_size) // kv_heads, dim=2)


def tokens_to_heads(t: torch.Tensor, group) -> torch.Tensor:
    """``[s / N, b, h, d]`` (this rank's block of tokens, every head) to ``[s, b, h / N, d]`` (every token, this
    rank's heads): megatron-core's ``all_to_all_sp2hp`` over the context-parallel ``group`` (autograd: the inverse)."""
    s, b, h, d = t.shape
    n = group.size()
    return all_to_all_sp2hp(t.reshape(s * b, h * d), group).reshape(s * n, b, h // n, d)


def heads_to_tokens(t: torch.Tensor, group) -> torch.Tensor:
    """``[s, b, h / N * d]`` (every token, this rank's heads) to ``[s / N, b, h * d]`` (this rank's tokens, every
    head): megatron-core's ``all_to_all_hp2sp`` over ``group``."""
    s, b, hd = t.shape
    n = group.size()
    return all_to_all_hp2sp(t.reshape(s * b, hd), group).reshape(s // n, b, hd * n)
