"""Run a plan's chunks through one ElasticAttention as the elastic schedule does (no pipeline, no model).

Each chunk gets random leaf ``q``/``k``/``v`` (``[N, 1, heads, d]``) and a random output gradient;
chunks run forward in plan order and backward in the schedule's backward order (a split sequence's
slices last-to-first), so the prefix K/V and their gradients (the sequences' K/V buffers, ``_SliceKV``)
flow exactly as in training. Each chunk is current in the attention's own context while it runs.
Used by the CPU contract test and by ``scripts/check_cuda_attention.py``.

Also reference implementations of the two varlen kernels' documented semantics in plain torch (``einsum``
+ ``softmax``, not SDPA), which stand in for them on CPU: flash-attn's ``flash_attn_varlen_func`` (2.1+
docstring) and torch's ``torch.nn.attention.varlen.varlen_attn`` (torch 2.13's signature, and torch 2.11's
without ``enable_gqa``). Both: q/k/v packed as ``(total, heads, d)``, one (q-sequence, k-sequence) pair per
``cu_seqlens`` entry, causal aligned to the bottom-right corner, GQA by query-head groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_epp.executor.context import ChunkContext, ChunkLayout
from megatron_epp.executor.attention import ElasticAttention
from megatron_epp.executor.kernels import FlashKernel, TorchVarlenKernel, torch_varlen_kernel
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


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal: bool, strict: bool = True):
    """Varlen attention in plain torch, forward and backward: sequence pair ``i`` is queries
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` over keys ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``; ``causal``: query ``r``
    sees key ``j`` iff ``j <= r + sk - sq`` (bottom-right); query head ``h`` reads K/V head ``h // (heads /
    kv_heads)``. Checks the arguments' contract (``strict``: ``cu_seqlens_k`` covers every key; a real kernel
    does not check that, it leaves the keys after it unread)."""
    assert q.dim() == k.dim() == v.dim() == 3 and k.shape == v.shape and q.shape[2] == k.shape[2]
    assert q.shape[1] % k.shape[1] == 0, "heads of q must be a multiple of heads of k/v"
    for cu, total in ((cu_seqlens_q, q.shape[0]), (cu_seqlens_k, k.shape[0])):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == q.device
        assert int(cu[0]) == 0 and int(cu[-1]) <= total, f"cu_seqlens {cu.tolist()} past the {total} tokens"
        assert not strict or int(cu[-1]) == total, f"cu_seqlens end {int(cu[-1])} != total tokens {total}"
    assert cu_seqlens_q.shape == cu_seqlens_k.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    outputs = []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qi, ki, vi = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        sq, sk = qi.shape[0], ki.shape[0]
        assert sq <= max_seqlen_q and sk <= max_seqlen_k
        ki, vi = ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1)  # q head h -> kv head h // group
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        if causal:  # bottom-right: query r sees key j iff j <= r + sk - sq
            keep = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + (sk - sq)
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked row gives zeros
        outputs.append(torch.einsum("hqk,khd->qhd", probs, vi))
    return torch.cat(outputs)


def reference_flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):
    """``flash_attn.flash_attn_varlen_func`` (2.1+) as documented, in plain torch, forward and backward."""
    assert (window_size == (-1, -1) or tuple(window_size) == (-1, -1)) and not softcap and alibi_slopes is None
    assert not return_attn_probs and block_table is None and dropout_p == 0.0
    return reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)


REFERENCE_KERNEL = FlashKernel(reference_flash_attn_varlen_func, "reference", devices=("cpu",), dtypes=(torch.float32,), min_capability=None)


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                          window_size=(-1, -1), enable_gqa=False, strict=True):
    """torch 2.13's ``torch.nn.attention.varlen.varlen_attn`` as documented and written there, in plain torch:
    causal iff ``window_size == (-1, 0)`` (a tuple: torch compares it so, a list is not causal), any other window
    refused here; fewer K/V heads than query heads only with ``enable_gqa``; no dropout argument."""
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={query.shape[1]} and Hkv={key.shape[1]}")
    assert return_aux is None and tuple(window_size) in ((-1, -1), (-1, 0))
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size == (-1, 0), strict)


def reference_varlen_attn_without_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                                      window_size=(-1, -1)):
    """:func:`reference_varlen_attn` with torch 2.11's signature: no ``enable_gqa`` (equal head counts only)."""
    return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux, scale=scale, window_size=window_size)


def reference_torch_varlen(takes_gqa: bool = True, func=None) -> TorchVarlenKernel:
    """A :class:`TorchVarlenKernel` in float32 for ``func`` (default: the reference of torch 2.13's signature, or
    2.11's without ``takes_gqa``), its GQA read from its signature as the real probe reads it; on CPU, and on CUDA
    (the equivalence suite's fp32 runs where they run on GPUs)."""
    func = func or (reference_varlen_attn if takes_gqa else reference_varlen_attn_without_gqa)
    kernel, why_not = torch_varlen_kernel(func, "reference", devices=("cpu", "cuda"), dtypes=(torch.float32,), min_capability=None)
    assert kernel is not None, why_not
    return kernel
