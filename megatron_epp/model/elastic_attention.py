"""Core attention for elastic chunks: block-diagonal causal packing plus prefix K/V for slices.

Every segment attends causally to itself only (one SDPA call per segment, so a packed chunk costs
the sum of its segments' squares, not the square of its length); the tokens of a slice (split chunk,
or the tail of a hybrid chunk) also attend to all K/V of the sequence's earlier slices, placed first
in the key order. Every segment uses an explicit bottom-right causal mask over its ``C + s`` keys
(built once per chunk): the same kernel for every segment, which is what the CPU cost profile fits.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_epp.model.chunk_state import CHUNK_STATE, ChunkLayout


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


def segment_attention(q, k, v, mask: torch.Tensor, dropout: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """One segment's attention, [s, b, heads, d] in and out, under a bottom-right causal ``mask``."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.permute(2, 0, 1, 3)


class ElasticAttention(MegatronModule):
    """Drop-in for ``SelfAttentionSubmodules.core_attention``: [s, b, heads, dim] in, [s, b, h] out."""

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
    ) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("ElasticAttention takes its packing from the current chunk, not packed_seq_params/bias")
        layout = CHUNK_STATE.layout()
        prefix = None
        if layout.split_index is not None:
            prefix, key, value = self._exchange_prefix(layout, key, value)
        dropout = self.dropout_p if self.training else 0.0
        outputs = []
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext():
            for index, (start, end) in enumerate(layout.bounds):
                q, k, v = query[start:end], key[start:end], value[start:end]
                if index == layout.split_index and prefix is not None:
                    k, v = torch.cat([prefix[0], k]), torch.cat([prefix[1], v])
                outputs.append(segment_attention(q, k, v, layout.masks[index], dropout, self.softmax_scale))
        out = torch.cat(outputs)
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _exchange_prefix(self, layout: ChunkLayout, key: torch.Tensor, value: torch.Tensor):
        """``(earlier slices' K/V or None, key, value)``; keeps this slice's K/V for later slices.

        The returned ``key``/``value`` carry :class:`_ReceiveLaterSliceGrads`, through which the kept
        leaves' gradients reach this slice in its own backward.
        """
        store = CHUNK_STATE.store(layout.split_seq, self.layer_number)
        prefix = store.prefix(layout.context) if layout.context else None
        if layout.keeps_kv:
            start, end = layout.bounds[layout.split_index]
            fresh = (key[start:end].detach().requires_grad_(), value[start:end].detach().requires_grad_())
            k_leaf, v_leaf = store.slices.setdefault(layout.context, fresh)  # a recompute reuses the kept leaves
            seq, layer = layout.split_seq, self.layer_number
            release = (lambda: CHUNK_STATE.release(seq, layer)) if layout.context == 0 else None
            key, value = _ReceiveLaterSliceGrads.apply(key, value, k_leaf, v_leaf, start, end, release)
        return prefix, key, value
