"""Run a plan's chunks through one ElasticAttention as the elastic schedule does (no pipeline, no model).

Each chunk gets random leaf ``q``/``k``/``v`` (``[N, 1, heads, d]``) and a random output gradient;
chunks run forward in plan order and backward in the schedule's backward order (a split sequence's
slices last-to-first), so the prefix K/V and their gradients (the sequences' K/V buffers, ``_SliceKV``)
flow exactly as in training. Each chunk is current in the attention's own context while it runs.
Used by the CPU contract test and by ``benchmarks/check_cuda_attention.py``.

Also reference implementations of the two varlen kernels' documented semantics in plain torch (``einsum``
+ ``softmax``, not SDPA), which stand in for them on CPU: flash-attn's ``flash_attn_varlen_func`` (2.1+
docstring) and torch's ``torch.nn.attention.varlen.varlen_attn`` (torch 2.13's signature, and torch 2.11's
without ``enable_gqa``), and of the two aten ops under it, ``aten::_flash_attention_forward`` /
``_flash_attention_backward`` (the forward's log-sum-exp, the backward from the saved output and log-sum-exp,
``dk``/``dv`` at the K/V heads' width). All: q/k/v packed as ``(total, heads, d)``, one (q-sequence, k-sequence)
pair per ``cu_seqlens`` entry, causal aligned to the bottom-right corner, GQA by query-head groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_epp.executor.context import ChunkContext, ChunkView, VarlenSeqlens, sequence_slices
from megatron_epp.executor.attention import ElasticAttention
from megatron_epp.executor.kernels import AtenFlashVarlen, BlockFlashKernel, FlashKernel, FlashOps, TorchVarlenKernel, torch_varlen_kernel
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
    """Forward every chunk (plan order), then backward (schedule order); outputs and input gradients. A pipeline's
    ``kv_host`` sequences keep their K/V buffers on the host (``executor.kv_host``: its views given the slices)."""
    results = []
    context = attention.context
    with context.step():
        for pipe, row in zip(plan.pipelines, tensors):
            host = {"slices": sequence_slices(pipe.chunks, plan.seq_lengths), "kv_host": set(pipe.kv_host)} if pipe.kv_host else {}
            layouts = [ChunkView.build(c, plan.seq_lengths, torch.device(device), **host) for c in pipe.chunks]
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


class SavedTensors:
    """What autograd saves for backward while this is entered (``torch.autograd.graph.saved_tensors_hooks``): each saved
    tensor's shape and storage, and the bytes of the distinct storages (views of one buffer count once). Records,
    holds no tensor."""

    def __init__(self) -> None:
        self.saved: list[tuple[tuple[int, ...], int]] = []  # (shape, storage address) per saved tensor
        self.storages: dict[int, int] = {}  # storage address -> bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.saved.append((tuple(tensor.shape), storage.data_ptr()))
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def heads_wide(self, heads: int, besides: set[int]) -> list[tuple[int, ...]]:
        """Shapes of the saved ``[rows, heads, d]`` tensors whose storage is none of ``besides`` (the queries' and the
        outputs'): with fewer K/V heads than ``heads``, K/V expanded to the query heads."""
        return [shape for shape, address in self.saved if len(shape) == 3 and shape[1] == heads and address not in besides]


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


def reference_fa4_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                              softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0, num_splits=1,
                              pack_gqa=None, deterministic=False, return_lse=False, **unused):
    """flash-attn-4's ``flash_attn.cute.flash_attn_varlen_func`` (4.0.0b36) as documented, in plain torch: causal
    bottom-right aligned, GQA without expanded K/V, ``(out, lse)`` returned (``lse`` None here: not asked for)."""
    assert qv is None and tuple(window_size) == (None, None) and not softcap and num_splits == 1 and not return_lse
    assert not any(value is not None for value in unused.values()), unused
    return reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal), None


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


def _varlen_pairs(q, k, cum_seq_q, cum_seq_k, max_q: int, max_k: int, strict: bool = True):
    """Each sequence pair's query and key rows, after the aten flash ops' argument contract is checked (``strict``: the
    ``cum_seq`` cover every row, which the real kernel does not check)."""
    assert q.dim() == k.dim() == 3 and q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0, (q.shape, k.shape)
    for cu, total in ((cum_seq_q, q.shape[0]), (cum_seq_k, k.shape[0])):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == q.device and int(cu[0]) == 0 and int(cu[-1]) <= total
        assert not strict or int(cu[-1]) == total, f"cum_seq end {int(cu[-1])} != total rows {total}"
    cq, ck = cum_seq_q.tolist(), cum_seq_k.tolist()
    assert len(cq) == len(ck) and max(b - a for a, b in zip(cq, cq[1:])) <= max_q and max(b - a for a, b in zip(ck, ck[1:])) <= max_k
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def _scores(qi, ki, scale: float, group: int, causal: bool = True):
    """Scores ``[heads, sq, sk]`` of one pair in float32 (K/V head ``h // group`` for query head ``h``), ``-inf`` where
    the bottom-right causal mask hides the key (``causal``; else every key seen)."""
    scores = torch.einsum("qhd,khd->hqk", qi.float(), ki.float().repeat_interleave(group, dim=1)) * scale
    if not causal:
        return scores
    sq, sk = qi.shape[0], ki.shape[0]
    keep = torch.arange(sk, device=qi.device)[None, :] <= torch.arange(sq, device=qi.device)[:, None] + (sk - sq)
    return scores.masked_fill(~keep, float("-inf"))


def _check_flash_call(dropout_p, is_causal, scale, window_size_left, window_size_right) -> None:
    """The library's two calls of the aten ops, no dropout and a scale either way: causal, window ``(-1, 0)`` (what
    ``varlen_attn(..., window_size=(-1, 0))`` passes; ``kernels.BlockFlashKernel`` over a slice's own block), or
    non-causal, window ``(-1, -1)`` (``BlockFlashKernel`` over a prefix block)."""
    assert dropout_p == 0.0 and is_causal in (True, False) and scale is not None, (dropout_p, is_causal, scale)
    window = (-1, 0) if is_causal else (-1, -1)
    assert (window_size_left, window_size_right) == window, (is_causal, window_size_left, window_size_right)


def reference_flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                                      *, scale=None, window_size_left=None, window_size_right=None, strict=True):
    """``aten::_flash_attention_forward``'s varlen path as torch 2.11 / 2.13 have it, in plain torch (math, float32
    inside): ``(out [T_q, heads, d], lse [heads, T_q] float32, rng_state [2] uint64, unused, debug mask (empty))``,
    fewer K/V heads than query heads taken as FlashAttention-2 takes them (query head ``h`` reads K/V head
    ``h // (heads / kv_heads)``), causal bottom-right aligned or not (``is_causal``). Only the library's calls
    (:func:`_check_flash_call`) are accepted."""
    _check_flash_call(dropout_p, is_causal, scale, window_size_left, window_size_right)
    assert return_debug_mask is False
    group = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[1], query.shape[0], dtype=torch.float32, device=query.device)
    for qs, ks in _varlen_pairs(query, key, cum_seq_q, cum_seq_k, max_q, max_k, strict):
        scores = _scores(query[qs], key[ks], scale, group, is_causal)
        lse[:, qs] = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[:, qs, None])
        out[qs] = torch.einsum("hqk,khd->qhd", probs, value[ks].float().repeat_interleave(group, dim=1)).to(query.dtype)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)
    return out, lse, rng_state, torch.empty(0, device=query.device), torch.empty(0, dtype=query.dtype, device=query.device)


def reference_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                       is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None,
                                       strict=True):
    """``aten::_flash_attention_backward`` as documented by FlashAttention-2, in plain torch from what the forward
    saved: ``P = exp(S - lse)`` from the GIVEN log-sum-exp, ``D = rowsum(dO * out)`` from the GIVEN output (so a wrong
    ``out`` or ``lse`` passed back gives wrong gradients), ``dS = P (dO V^T - D)``; ``dk``/``dv`` summed over each K/V
    head's query heads: ``(dq [T_q, heads, d], dk, dv [T_k, kv_heads, d])``; causal or not (``is_causal``)."""
    _check_flash_call(dropout_p, is_causal, scale, window_size_left, window_size_right)
    assert out.shape == grad_out.shape == query.shape and logsumexp.shape == (query.shape[1], query.shape[0])
    assert rng_state.dtype == torch.uint64 and rng_state.shape == (2,)
    heads, kv_heads = query.shape[1], key.shape[1]
    group = heads // kv_heads
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (query, key, value))
    for qs, ks in _varlen_pairs(query, key, cum_seq_q, cum_seq_k, max_q, max_k, strict):
        qi, ki, vi = query[qs].float(), key[ks].float().repeat_interleave(group, dim=1), value[ks].float().repeat_interleave(group, dim=1)
        sk = ki.shape[0]
        probs = torch.exp(_scores(query[qs], key[ks], scale, group, is_causal) - logsumexp[:, qs, None])  # hidden keys: exp(-inf) = 0
        do = grad_out[qs].float()
        dv_heads = torch.einsum("hqk,qhd->khd", probs, do)
        delta = (do * out[qs].float()).sum(-1).transpose(0, 1)  # [heads, sq]
        ds = probs * (torch.einsum("qhd,khd->hqk", do, vi) - delta[..., None])
        dq[qs] = torch.einsum("hqk,khd->qhd", ds, ki) * scale
        dk_heads = torch.einsum("hqk,qhd->khd", ds, qi) * scale
        dk[ks] = dk_heads.view(sk, kv_heads, group, query.shape[2]).sum(2)
        dv[ks] = dv_heads.view(sk, kv_heads, group, value.shape[2]).sum(2)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


REFERENCE_FLASH_OPS = FlashOps(reference_flash_attention_forward, reference_flash_attention_backward)


def reference_varlen_attn_saving_as_torch(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                                          window_size=(-1, -1)):
    """torch 2.11's ``varlen_attn`` (no ``enable_gqa``) with what its autograd saves: like torch's custom op it runs the
    aten flash ops (here the references, through :class:`AtenFlashVarlen`) and saves q, k, v as given, the output and the
    log-sum-exp; where the memory saved matters (the plain reference's autograd saves its einsum operands instead).
    Causal only (``window_size=(-1, 0)``, the library's call)."""
    assert return_aux is None and tuple(window_size) == (-1, 0) and query.shape[1] == key.shape[1] == value.shape[1]
    return AtenFlashVarlen.apply(query, key, value, VarlenSeqlens(cu_seq_q, cu_seq_k, max_q, max_k), scale, REFERENCE_FLASH_OPS)
VARLEN_GQA_MODES = {  # each GQA mode of torch-varlen: the varlen_attn signature and the aten flash ops it comes with
    "enable_gqa": (reference_varlen_attn, (None, "aten flash ops not used: varlen_attn has enable_gqa")),
    "aten-flash": (reference_varlen_attn_without_gqa, (REFERENCE_FLASH_OPS, "")),
    "expanded": (reference_varlen_attn_without_gqa, (None, "reference: no aten flash ops")),
}


def reference_torch_varlen(gqa: str = "enable_gqa", func=None) -> TorchVarlenKernel:
    """A :class:`TorchVarlenKernel` in float32 whose GQA mode is ``gqa`` (``VARLEN_GQA_MODES``): the reference
    ``varlen_attn`` of torch 2.13's signature (``enable_gqa``) or of 2.11's (without it), with the reference aten
    flash ops (``aten-flash``) or none (``expanded``); ``func`` in place of that ``varlen_attn``. Its GQA read from
    the signature as the real probe reads it; on CPU, and on CUDA (the equivalence suite's fp32 runs where they run
    on GPUs)."""
    default, flash_ops = VARLEN_GQA_MODES[gqa]
    kernel, why_not = torch_varlen_kernel(func or default, "reference", flash_ops, devices=("cpu", "cuda"), dtypes=(torch.float32,),
                                          min_capability=None)
    assert kernel is not None, why_not
    return kernel


# the CUDA block kernel of K/V buffers on the host (kernels.BlockFlashKernel) over the reference aten flash ops, on CPU in
# float32 (the real one takes CUDA fp16/bf16 only)
REFERENCE_BLOCK_FLASH = BlockFlashKernel(REFERENCE_FLASH_OPS, devices=("cpu",), dtypes=(torch.float32,), min_capability=None)
