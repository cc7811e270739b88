"""The host work of one elastic layer per chunk: the aten ops it dispatches, pinned per op name.

A stack of one and of two layers of the training spec (``measure.layer_bench.LayerStack``: ``elastic_layer_spec``
on the local spec, :class:`ChunkRopeSelfAttention`, :class:`ElasticAttention`, the chunk rotary embedding) runs
one packed chunk of two documents forward and backward, each pass inside its own ``ChunkContext.running`` as
the schedule runs it; a ``TorchDispatchMode`` counts every aten op (views included: each costs a dispatch on
the host). One layer's ops are the two-layer stack's minus the one-layer stack's; what is left of the
one-layer stack is the per-chunk share (RoPE's tables, built once per pass and shared by the layers).

The RoPE of megatron-core's training path (``apply_rotary_pos_emb``: ``cos``/``sin``, their casts, ``cat``
per layer for q and for k) cost 78 forward and 101 backward ops per layer in fp32 (82 and 101 in bf16) on
this GPT-style layer and chunk; :mod:`megatron_epp.executor.rotary`'s shared tables leave 60 and 87 in both
dtypes, plus 5 ops per chunk and pass (7 in bf16) for the tables.
``test_per_layer_rope_is_counted`` plants the old path back (the rotary embedding hands the layers raw
frequencies again) and finds those counts. The rotation itself is megatron-core's bit for bit, outputs and
gradients, fp32 and bf16, with grouped-query attention (``test_rotation_is_megatrons_bit_for_bit``).
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_epp.cost.shape import ModelShape
from megatron_epp.executor import rotary, spec
from megatron_epp.executor.context import ChunkContext, ChunkView
from megatron_epp.plan import Chunk, Segment
from megatron_epp.measure.layer_bench import LayerStack, init_single_process

# GPT-style, as the H100 h1024 runs (LayerNorm, GELU, biases), at hidden 32
SHAPE = ModelShape("gpt-h32", 2, 32, 4, 64, 64, swiglu=False)
SEGMENTS = [5, 3]  # one packed chunk of two documents

# one layer, per chunk; the same in fp32 and bf16 (the tables are cast once per pass, not per layer)
LAYER_FORWARD = {
    "native_layer_norm": 2, "t": 4, "mm": 4, "add": 6, "view": 11, "_unsafe_view": 4, "split_with_sizes": 1, "gelu": 1,
    "mul": 2, "roll": 2, "mul_": 2, "add_": 2,  # RoPE of q and k: t cos + roll(t) sin', no cat, no cos/sin
    "slice": 6, "permute": 8, "_scaled_dot_product_flash_attention_for_cpu": 2, "detach": 2, "cat": 1,
}
LAYER_BACKWARD = {
    "sum": 4, "view": 18, "add_": 14, "mm": 8, "_unsafe_view": 4, "t": 4, "gelu_backward": 1, "native_layer_norm_backward": 2,
    "mul": 4, "roll": 2,  # RoPE of q and k: g cos + roll(g sin')
    "add": 5, "slice": 2, "permute": 8, "detach": 2, "_scaled_dot_product_flash_attention_for_cpu_backward": 2,
    "slice_backward": 6, "cat": 1,
}
# per chunk and pass, shared by the stage's layers: RoPE's cos and sin' (gather, cos, sin, the half negated);
# in bf16 also their two casts
TABLES = {"index": 1, "cos": 1, "sin": 1, "slice": 1, "neg_": 1}
CASTS = {"_to_copy": 2}
# megatron-core's RoPE per layer (the planted old path): forward (fp32, bf16) and backward ops of one layer
OLD_LAYER = {torch.float32: (78, 101), torch.bfloat16: (82, 101)}


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def chunk_stack(num_layers: int, dtype: torch.dtype):
    """A ``num_layers`` stack over one packed chunk, and a function running one forward and one backward of it
    (each in its own ``running`` pass), counted: ``(forward ops, backward ops)``."""
    stack = LayerStack(SHAPE, num_layers, dtype=dtype)
    stack.set_segments(SEGMENTS, [0] * len(SEGMENTS))
    view = stack.context.view()
    x = torch.randn(sum(SEGMENTS), 1, SHAPE.hidden, dtype=dtype, requires_grad=True)
    grad = torch.randn(sum(SEGMENTS), 1, SHAPE.hidden, dtype=dtype)

    def run() -> tuple[collections.Counter, collections.Counter]:
        view.transient.clear()
        with CountOps() as forward:
            y = stack(x)
        with stack.context.running(view), CountOps() as backward:
            y.backward(grad)
        return forward.ops, backward.ops

    return stack, run


def stack_ops(num_layers: int, dtype: torch.dtype) -> tuple[collections.Counter, collections.Counter]:
    """Forward and backward ops of a ``num_layers`` stack over one chunk (after a warm-up pass)."""
    _, run = chunk_stack(num_layers, dtype)
    run()
    return run()


def per_layer_and_chunk(dtype: torch.dtype):
    (f1, b1), (f2, b2) = stack_ops(1, dtype), stack_ops(2, dtype)
    layer_f, layer_b = f2 - f1, b2 - b1
    return dict(layer_f), dict(layer_b), dict(f1 - layer_f), dict(b1 - layer_b)


def nonzero(table: dict) -> dict:
    return {k: v for k, v in table.items() if v}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_ops_per_chunk_are_pinned(dtype):
    layer_f, layer_b, chunk_f, chunk_b = per_layer_and_chunk(dtype)
    assert layer_f == LAYER_FORWARD, f"one layer's forward ops changed: {sum(layer_f.values())} ops {layer_f}"
    assert layer_b == LAYER_BACKWARD, f"one layer's backward ops changed: {sum(layer_b.values())} ops {layer_b}"
    assert (sum(layer_f.values()), sum(layer_b.values())) == (60, 87)
    tables = {**TABLES, **(CASTS if dtype == torch.bfloat16 else {})}
    assert chunk_f == tables, f"per chunk forward: {chunk_f}"
    assert chunk_b == {**tables, "add_": 1}, f"per chunk backward: {chunk_b}"  # + the stack input's gradient


def test_per_layer_rope_is_counted(monkeypatch):
    """The counter sees the old path planted back: raw frequencies to every layer, megatron-core's RoPE per layer."""
    monkeypatch.setattr(rotary.ChunkRotaryEmbedding, "forward",
                        lambda self, *args, **kwargs: rotary.ChunkRope(self.table, self.context.view()).freqs())
    for dtype, counts in OLD_LAYER.items():
        layer_f, layer_b, chunk_f, _ = per_layer_and_chunk(dtype)
        assert (sum(layer_f.values()), sum(layer_b.values())) == counts, (dtype, layer_f, layer_b)
        assert layer_f["cos"] == layer_f["sin"] == 2 and layer_f["cat"] == 5 and chunk_f == {"index": 1}
        assert layer_f != LAYER_FORWARD and layer_b != LAYER_BACKWARD


def tp_group_warnings() -> int:
    """``tp_group is None`` deprecation warnings a warm two-layer stack issues in one forward and backward."""
    _, run = chunk_stack(2, torch.float32)
    run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return sum("tp_group is None" in str(w.message) for w in caught)


def test_no_tp_group_lookup_per_call(monkeypatch):
    """The row-parallel linears pass their group (``GroupRowParallelLinear``): megatron-core's own warn twice per
    layer forward (a lookup and a warning, ~35 us per call on CPU); planted back, the warnings are counted."""
    assert tp_group_warnings() == 0
    monkeypatch.setattr(spec, "_own_group_linears", lambda layer_spec: None)
    assert tp_group_warnings() == 4


@pytest.mark.parametrize("percent", [1.0, 0.5], ids=["whole-head", "rotary-percent-0.5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotation_is_megatrons_bit_for_bit(dtype, percent):
    """:meth:`ChunkRope.rotate` (from the run's table of 64 positions) against megatron-core's ``apply_rotary_pos_emb`` on
    megatron-core's own frequencies for the chunk (its ``RotaryEmbedding`` called with the chunk's length, gathered at
    its positions): the frequencies, outputs and the gradients of q and k identical (grouped-query attention: 8 query
    heads, 2 K/V heads), positions of a slice at context 4 and a packed document."""
    init_single_process()
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    chunk = Chunk(0, "hybrid", [Segment(0, 0, 6), Segment(1, 4, 9)])
    view = ChunkView.build(chunk, [6, 20], torch.device("cpu"))
    inner = RotaryEmbedding(16, percent, rotary_base=500000, use_cpu_initialization=True)
    rope = rotary.ChunkRope(rotary.RopeTable(inner, 64), view)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(view.num_tokens, 2, heads, 16, generator=gen).to(dtype) for heads in (8, 2))
    gq, gk = torch.randn_like(q, dtype=torch.float32).to(dtype), torch.randn_like(k, dtype=torch.float32).to(dtype)
    config = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=8, use_cpu_initialization=True)

    def grads(rotate):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        out_q, out_k = rotate(qq, kk)
        torch.autograd.backward([out_q, out_k], [gq, gk])
        return out_q, out_k, qq.grad, kk.grad

    freqs = inner(view.max_position + 1)[view.position_ids]  # megatron-core's table of the chunk's length
    assert freqs.dtype == torch.float32 and torch.equal(rope.freqs(), freqs)
    theirs = grads(lambda a, b: (apply_rotary_pos_emb(a, freqs, config), apply_rotary_pos_emb(b, freqs, config)))
    with ChunkContext().running(view):  # the tables of one pass, dropped after it
        ours = grads(rope.rotate)
    assert view.transient == {}
    for name, a, b in zip(("q", "k", "grad q", "grad k"), ours, theirs):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b), name


def test_partial_rotary_passes_the_rest_unrotated():
    """``--rotary-percent 0.5``: the last half of each head passes unchanged, forward and backward (a rotation that
    touched it, or dropped it, is red here and in the bit-for-bit test above)."""
    init_single_process()
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    view = ChunkView.build(Chunk(0, "batched", [Segment(0, 0, 4)]), [4], torch.device("cpu"))
    rope = rotary.ChunkRope(rotary.RopeTable(RotaryEmbedding(16, 0.5, use_cpu_initialization=True), 4), view)
    q, k = torch.randn(4, 1, 2, 16, requires_grad=True), torch.randn(4, 1, 2, 16, requires_grad=True)
    with ChunkContext().running(view):
        out_q, out_k = rope.rotate(q, k)
        (out_q.sum() + out_k.sum()).backward()
    assert rope.rotary_dim == 8 and out_q.shape == q.shape
    assert torch.equal(out_q[..., 8:], q[..., 8:]) and torch.equal(out_k[..., 8:], k[..., 8:])
    assert not torch.equal(out_q[1:, ..., :8], q[1:, ..., :8])  # position 0 is the identity; later ones rotate
    assert torch.equal(q.grad[..., 8:], torch.ones(4, 1, 2, 8))
