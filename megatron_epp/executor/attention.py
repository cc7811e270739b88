"""Core attention for elastic chunks: block-diagonal causal packing plus prefix K/V for slices.

Every segment attends causally to itself only (a packed chunk costs the sum of its segments'
squares, not the square of its length); the tokens of a slice (split chunk, or the tail of a hybrid
chunk) also attend to all K/V of the sequence's earlier slices, placed first in the key order
(bottom-right causal over its ``C + s`` keys). The kernel is chosen once by
``EPP_ATTENTION_BACKEND`` (see ``attention_kernels``): on CPU every segment is one SDPA under an
explicit mask (what the CPU cost profile fits); on CUDA the whole chunk is one flash-attn varlen
call, or SDPA with ``is_causal`` where there is no context.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_epp.executor import kernels
from megatron_epp.executor.context import ChunkContext, ChunkLayout


class _ReceiveLaterSliceGrads(torch.autograd.Function):
    """Identity on a chunk's K and V; backward adds what later slices accumulated on the kept leaves.

    Later slices run backward first (slices go last-to-first), so by the time this slice's backward
    reaches attention, ``k_leaf.grad``/``v_leaf.grad`` hold the gradients of every later slice.
    """

    @staticmethod
    def forward(ctx, key, value, k_leaf, v_leaf, start: int, end: int, on_backward: Callable[[], None] | None):
        ctx.leaves, ctx.span, ctx.on_backward = (k_leaf, v_leaf), (start, end), on_backward
        return key.view_as(key), value.view_as(value)

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        start, end = ctx.span
        grads = []
        for grad, leaf in zip((grad_key, grad_value), ctx.leaves):
            if leaf.grad is not None:
                grad = grad.clone()
                grad[start:end] += leaf.grad
            grads.append(grad)
        if ctx.on_backward is not None:
            ctx.on_backward()
        return grads[0], grads[1], None, None, None, None, None


class ElasticAttention(MegatronModule):
    """Drop-in for ``SelfAttentionSubmodules.core_attention``: [s, b, heads, dim] in, [s, b, h] out.

    ``context`` (from the layer spec's ``params``) gives the current chunk and keeps the prefix K/V.
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
        pg_collection: Any = None,
        *,
        context: ChunkContext,
    ) -> None:
        super().__init__(config=config)
        self.context = context
        self.layer_number = layer_number
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.deterministic = bool(getattr(config, "deterministic_mode", False))
        self.backend_request = kernels.requested_backend()  # EPP_ATTENTION_BACKEND, checked here
        kernels.check_request(self.backend_request)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("ElasticAttention takes its packing from the current chunk, not packed_seq_params/bias")
        layout = self.context.layout()
        prefix = None
        if layout.split_index is not None:
            prefix, key, value = self._exchange_prefix(layout, key, value)
        dropout = self.dropout_p if self.training else 0.0
        backend = kernels.select_backend(self.backend_request, query.device, query.dtype)
        kwargs = {"deterministic": self.deterministic} if backend == "flash-varlen" else {}
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext():
            out = kernels.BACKENDS[backend](query, key, value, layout, prefix, dropout, self.softmax_scale, **kwargs)
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _exchange_prefix(self, layout: ChunkLayout, key: torch.Tensor, value: torch.Tensor):
        """``(earlier slices' K/V or None, key, value)``; keeps this slice's K/V for later slices.

        The returned ``key``/``value`` carry :class:`_ReceiveLaterSliceGrads`, through which the kept
        leaves' gradients reach this slice in its own backward.
        """
        store = self.context.store(layout.split_seq, self.layer_number)
        prefix = store.prefix(layout.context) if layout.context else None
        if layout.keeps_kv:
            start, end = layout.bounds[layout.split_index]
            fresh = (key[start:end].detach().requires_grad_(), value[start:end].detach().requires_grad_())
            seq, layer = layout.split_seq, self.layer_number
            k_leaf, v_leaf = self.context.keep(seq, layer, layout.context, fresh)
            release = (lambda: self.context.release(seq, layer)) if layout.context == 0 else None
            key, value = _ReceiveLaterSliceGrads.apply(key, value, k_leaf, v_leaf, start, end, release)
        return prefix, key, value
