"""Run a plan's chunks through one ElasticAttention as the elastic schedule does (no pipeline, no model).

Each chunk gets random leaf ``q``/``k``/``v`` (``[N, 1, heads, d]``) and a random output gradient;
chunks run forward in plan order and backward in the schedule's backward order (a split sequence's
slices last-to-first), so the prefix K/V and their gradients (the sequences' K/V buffers, ``_SliceKV``)
flow exactly as in training. Each chunk is current in the attention's own context while it runs.
Used by the CPU contract test and by ``scripts/check_cuda_attention.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_epp.executor.context import ChunkContext, ChunkLayout
from megatron_epp.executor.attention import ElasticAttention
from megatron_epp.plan import Plan
from megatron_epp.plan.order import backward_order


def make_attention(
    heads: int, kv_heads: int, head_dim: int, dropout: float = 0.0, layer_number: int = 1, context: ChunkContext | None = None
) -> ElasticAttention:
    """One ElasticAttention on ``context`` (a fresh one if None)."""
    config = TransformerConfig(
        num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads, num_query_groups=kv_heads,
        kv_channels=head_dim, attention_dropout=dropout, hidden_dropout=0.0, use_cpu_initialization=True,
    )
    return ElasticAttention(config, layer_number=layer_number, context=context or ChunkContext())


@dataclass
class ChunkTensors:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor


def random_tensors(plan: Plan, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, seed: int) -> list[list[ChunkTensors]]:
    """Per pipeline, per chunk: q/k/v values and an output gradient (not yet leaves)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for pipe in plan.pipelines:
        row = []
        for chunk in pipe.chunks:
            n = chunk.num_tokens
            q, k, v = (torch.randn(n, 1, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
            g = torch.randn(n, 1, heads * head_dim, generator=gen)
            row.append(ChunkTensors(*(t.to(device=device, dtype=dtype) for t in (q, k, v, g))))
        out.append(row)
    return out


@dataclass
class ChunkResult:
    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def run_plan(attention: ElasticAttention, plan: Plan, tensors: list[list[ChunkTensors]], device) -> list[list[ChunkResult]]:
    """Forward every chunk (plan order), then backward (schedule order); outputs and input gradients."""
    results = []
    context = attention.context
    with context.step():
        for pipe, row in zip(plan.pipelines, tensors):
            layouts = [ChunkLayout.build(c, plan.seq_lengths, torch.device(device)) for c in pipe.chunks]
            leaves, outs = [], []
            for layout, t in zip(layouts, row):
                q, k, v = (x.detach().clone().requires_grad_() for x in (t.q, t.k, t.v))
                leaves.append((q, k, v))
                with context.running(layout):
                    outs.append(attention(q, k, v, attention_mask=None))
            for pos in backward_order(pipe):
                with context.running(layouts[pos]):
                    outs[pos].backward(row[pos].grad_out)
            results.append([ChunkResult(o.detach(), q.grad, k.grad, v.grad) for o, (q, k, v) in zip(outs, leaves)])
            if context.kv:
                raise AssertionError(f"K/V buffers not released after the pipeline: {sorted(context.kv)}")
    return results


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float64 (Frobenius norms), ``|b|`` floored at an rms of 0.01: the inputs
    are O(1), and a gradient that is zero in exact arithmetic (a one-token segment's ``dq``) is
    rounding noise in both. A NaN or infinity in either is an infinite error (a NaN would otherwise pass every
    ``<`` bound it is held to, and ``max`` drops it)."""
    a, b = a.double(), b.double()
    error = float((a - b).norm() / b.norm().clamp_min(0.01 * b.numel() ** 0.5))
    return error if math.isfinite(error) else math.inf


def worst_errors(results: list[list[ChunkResult]], reference: list[list[ChunkResult]]) -> dict[str, float]:
    """Worst relative error over all chunks of outputs and of q/k/v gradients."""
    worst = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    for row, ref_row in zip(results, reference):
        for r, ref in zip(row, ref_row):
            for name in worst:
                worst[name] = max(worst[name], relative_error(getattr(r, name), getattr(ref, name)))
    return worst
