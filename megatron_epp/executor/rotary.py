"""RoPE at each token's absolute position: a slice starts at C, packed sequences restart at 0.

``GPTModel._preprocess`` asks its ``rotary_pos_emb`` for positions ``0..s-1`` once per chunk forward and
hands the answer to every layer. :class:`ChunkRotaryEmbedding` answers with a :class:`ChunkRope` of the
current chunk: the run's :class:`RopeTable` (megatron-core's frequencies at every position up to the run's
``--seq-length``, built ONCE when the model is built, on the device megatron-core keeps RoPE's frequencies on)
gathered at the chunk's position ids, which is what RoPE with ``offset = C`` gives a slice and what
restarting at 0 gives packed sequences. Not megatron-core's ``RotaryEmbedding.forward`` per chunk: it
caches one fp32 table per length asked for (``lru_cache(maxsize=32)``), and elastic chunks ask for a new
length nearly every time, so up to 32 tables (about 0.5 GB at 32K positions) piled up on the device inside
the measured training steps, where the memory calibration took them for activations. The table is a plain
attribute, not a buffer: ``Float16Module`` would cast a buffer to bf16 (megatron-core keeps ``inv_freq`` so
for the same reason). A chunk whose positions pass the table is refused with one line.

megatron-core's training path (``apply_rotary_pos_emb``) computes ``cos``/``sin`` of those frequencies,
casts them, rotates half of ``t`` by a chunk, a negation and a concatenation, and concatenates ``t``
with its (empty) unrotated rest, for the query and again for the key of every layer; its
``rotary_pos_cos``/``rotary_pos_sin`` arguments are for inference only. Here the layers'
:class:`ChunkRopeSelfAttention` rotates query and key right after megatron-core's own QKV projection
(and QK norms, if any) with the chunk's tables, built once per forward and once per backward of the
chunk (``ChunkView.per_pass``) and shared by all the stage's layers: ``t cos + roll(t, d/2) sin'``
with ``sin'`` the sine with its first half negated, four kernels per tensor, no concatenation. Each
product and sum is the one megatron-core computes (``(-x) s = x (-s)`` exactly), so the result and
its gradients are bit-identical in every dtype (``tests/unit/test_layer_op_count.py``). The rotation saves
nothing for backward, which rebuilds the tables (megatron-core saves per layer a ``cos`` and a ``sin``
for the query and for the key).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention

from megatron_epp.executor import fused
from megatron_epp.executor.context import ChunkContext, ChunkView


class RopeTable:
    """RoPE's angles of one run: megatron-core's ``RotaryEmbedding`` frequencies at positions ``0 .. positions - 1``,
    ``[positions, 1, 1, rotary_dim]`` fp32, computed once by megatron-core's own ``get_emb`` (what its cached
    ``forward`` computes for a length, without the cache: the angle at a position does not depend on the length
    asked for, so every chunk's rows are bit for bit the ones megatron-core's per-length tables hold)."""

    __slots__ = ("inner", "freqs")

    def __init__(self, inner: RotaryEmbedding, positions: int) -> None:
        if positions < 1:
            raise ValueError(f"elastic RoPE: a table of {positions} positions")
        self.inner = inner
        self.freqs = inner.get_emb(positions)

    @property
    def positions(self) -> int:
        return self.freqs.shape[0]

    def at(self, view: ChunkView) -> torch.Tensor:
        """``[n, 1, 1, d]`` fp32: the angles at the positions of ``view``'s tokens on this rank (all ``N`` of the chunk
        without context parallelism; its largest known on the host: no device sync)."""
        if view.max_position >= self.positions:
            raise ValueError(f"elastic RoPE: chunk {view.chunk.id} reaches position {view.max_position}, past the run's table of "
                             f"--seq-length {self.positions} positions (documents are at most --seq-length tokens)")
        return self.freqs[view.local_position_ids]


class ChunkRope:
    """RoPE of one chunk, what :class:`ChunkRotaryEmbedding` gives ``GPTModel`` for its layers' ``rotary_pos_emb``."""

    __slots__ = ("table", "view")

    def __init__(self, table: RopeTable, view: ChunkView) -> None:
        self.table, self.view = table, view

    def freqs(self) -> torch.Tensor:
        """``[N, 1, 1, d]`` fp32: the angles at the chunk's positions (megatron-core's ``rotary_pos_emb``)."""
        return self.table.at(self.view)

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin'`` (first half negated), ``[N, 1, 1, d]`` in ``dtype``, once per pass of the chunk."""
        return self.view.per_pass((ChunkRope, self.table, dtype), lambda: self._build(dtype))

    def _build(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self.freqs()
        cos = torch.cos(freqs).to(dtype)  # megatron-core: (cos(freqs) * mscale).to(t.dtype), mscale 1 without YaRN
        sin = torch.sin(freqs).to(dtype)  # a fresh tensor either way: negated in place
        sin[..., : sin.shape[-1] // 2].neg_()
        return cos, sin

    def plain_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` (megatron-core's, the sine not negated), ``[N, 1, 1, d]`` in ``dtype``, once per pass of
        the chunk: what a fused RoPE kernel takes (:mod:`megatron_epp.executor.fused`)."""
        return self.view.per_pass((ChunkRope, self.table, dtype, "plain"), lambda: self._build_plain(dtype))

    def _build_plain(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self.freqs()
        return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)

    def rotate(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``query`` and ``key`` ``[N, b, heads, d]`` rotated to the chunk's positions (autograd through :class:`_Rotate`);
        with a rotary percent below 1 (``--rotary-percent``) only their first ``rotary_dim`` channels, as megatron-core."""
        return _Rotate.apply(query, key, self)

    @property
    def rotary_dim(self) -> int:
        return 2 * self.table.inner.inv_freq.numel()


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``t cos + rotate_half(t) sin`` as ``t cos + roll(t, d/2) sin'``: megatron-core's products and sum. Only the
    first ``cos.shape[-1]`` channels rotate (partial RoPE); the rest pass unchanged, after them, as megatron-core."""
    rotary_dim = cos.shape[-1]
    if rotary_dim != t.shape[-1]:
        return torch.cat((_rotate(t[..., :rotary_dim], cos, sin), t[..., rotary_dim:]), dim=-1)
    out = t * cos
    return out.add_(torch.roll(t, t.shape[-1] // 2, -1).mul_(sin))


def _rotate_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`_rotate`'s input: ``g cos + roll(g sin', d/2)`` (megatron-core's by autograd, exactly);
    the channels that pass unrotated (partial RoPE) keep their gradient."""
    rotary_dim = cos.shape[-1]
    if rotary_dim != grad.shape[-1]:
        return torch.cat((_rotate_backward(grad[..., :rotary_dim], cos, sin), grad[..., rotary_dim:]), dim=-1)
    out = grad * cos
    return out.add_(torch.roll(grad * sin, grad.shape[-1] // 2, -1))


class _Rotate(torch.autograd.Function):
    """Query and key rotated by one chunk's tables; saves no tensor (backward rebuilds the tables once per pass)."""

    @staticmethod
    def forward(ctx, query, key, rope: ChunkRope):
        ctx.rope = rope
        cos, sin = rope.tables(query.dtype)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    @staticmethod
    def backward(ctx, grad_query, grad_key):
        cos, sin = ctx.rope.tables(grad_query.dtype)
        return _rotate_backward(grad_query, cos, sin), _rotate_backward(grad_key, cos, sin), None


class ChunkRotaryEmbedding(torch.nn.Module):
    """Wraps megatron-core's ``RotaryEmbedding`` (no parameters of its own) at ``context``'s current chunk, with one
    :class:`RopeTable` of ``positions`` rows (the run's ``--seq-length``: no document is longer) for the run.

    :meth:`build_table` builds it; call it once the model is on its device (``install_chunk_context`` does), so that it
    is allocated with the model and never inside a training step. It stays a plain attribute (fp32 under
    ``Float16Module``, which casts buffers)."""

    def __init__(self, inner: torch.nn.Module, context: ChunkContext, positions: int) -> None:
        super().__init__()
        if type(inner) is not RotaryEmbedding or inner.rotary_interleaved:
            raise ValueError(f"elastic RoPE wraps megatron-core's RotaryEmbedding without interleaving, got {type(inner).__name__}"
                             + (" (interleaved)" if getattr(inner, "rotary_interleaved", False) else ""))
        self.inner = inner
        self.context = context
        self.positions = positions
        self.table: RopeTable | None = None

    def build_table(self) -> RopeTable:
        """The run's table, built now (on the device of megatron-core's ``inv_freq``, where its tables would be)."""
        self.table = RopeTable(self.inner, self.positions)
        return self.table

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None) -> ChunkRope:
        if self.table is None:
            raise RuntimeError("elastic RoPE: no table; build_table() (install_chunk_context) once the model is on its device")
        return ChunkRope(self.table, self.context.view())


class ChunkRopeSelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention`` (``spec.module`` of elastic layers) that rotates query and key by a
    :class:`ChunkRope` passed as ``rotary_pos_emb``; any other ``rotary_pos_emb`` goes to megatron-core as is.
    ``rope_backend`` (``ModuleSpec.params``): ``torch`` (:meth:`ChunkRope.rotate`), else the fused kernel of
    :func:`megatron_epp.executor.fused.kernel` on the chunk's plain cos/sin tables."""

    _rope: ChunkRope | None = None  # the rope of the forward under way (set and reset by forward)

    def __init__(self, *args, rope_backend: str = "torch", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rope_backend = rope_backend
        self._rope_kernel = None if rope_backend == "torch" else fused.kernel("rope", rope_backend)

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None, rotary_pos_emb=None,
                *args, **kwargs):
        if not isinstance(rotary_pos_emb, ChunkRope):
            return super().forward(hidden_states, attention_mask, key_value_states, inference_context, rotary_pos_emb, *args, **kwargs)
        if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
            rotary_pos_emb = None  # as megatron-core: this layer has no RoPE
        self._rope = rotary_pos_emb
        try:
            return super().forward(hidden_states, attention_mask, key_value_states, inference_context, None, *args, **kwargs)
        finally:
            self._rope = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        qkv = super().get_query_key_value_tensors(*args, **kwargs)
        if self._rope is None:
            return qkv
        query, key, *rest = qkv  # split_qkv: megatron-core's fused QKV RoPE needs a rotary_pos_emb, which it is not given
        if self._rope_kernel is not None:
            return (*self._rope_kernel(query, key, *self._rope.plain_tables(query.dtype)), *rest)
        return (*self._rope.rotate(query, key), *rest)
