"""The output head's linear cross entropy in token blocks (``--epp-loss-chunk-tokens``): the logits of a long chunk are
never whole on the device.

:class:`ChunkedLinearCrossEntropy` computes, block by block of ``block`` tokens, the output layer's logits (a matmul in
the activations' dtype, as megatron-core's ``ColumnParallelLinear``) and megatron-core's vocab-parallel cross entropy
over them in fp32 (each tensor-parallel rank its vocabulary shard: the max, then the target's logit and the sum of the
exponentials all-reduced over the tensor-parallel group per block, as ``vocab_parallel_cross_entropy``). Its forward
keeps only the head's input (the final norm's output; under sequence parallelism this rank's shard, gathered again in
backward, as megatron-core's linear keeps it), the targets (int32) and each token's log-sum-exp (fp32): ``b h / sp``
+ 8 bytes a token (and the loss mask, 4, which the loss's product saves as with the unchunked head), never the
``[tokens, vocab / tp]`` logits nor their softmax. Its backward recomputes each block's
logits, forms the softmax less the target's one-hot times the loss's gradient (megatron-core's formula), and
accumulates the gradients of the hidden states and of the output weight (in fp32 across blocks, cast to the weight's
dtype once); the weight's gradient goes to the weight passed in, the tied embedding's where megatron-core passes it.
The per-token loss returned is megatron-core's, so the loss mask and ``calculate_per_token_loss`` apply unchanged.
Plain torch: CPU and GPU alike. Equal to the unchunked head within fp32 rounding, not bitwise (the block matmuls and
the weight gradient's block-wise sum round in another order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather_tokens(hidden: torch.Tensor, group) -> torch.Tensor:
    """Sequence parallelism: every tensor-parallel rank's tokens (dim 0) gathered in rank order."""
    out = hidden.new_empty((hidden.shape[0] * group.size(), *hidden.shape[1:]))
    dist.all_gather_into_tensor(out, hidden.contiguous(), group=group)
    return out


def _block_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One block's logits ``[n, V / tp]`` in fp32 (the matmul in the activations' dtype, then cast, as megatron-core)."""
    return torch.matmul(x, weight.t()).float()


def _local_targets(targets: torch.Tensor, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The targets as indices into this rank's vocabulary shard ``[start, start + size)`` (0 where outside) and
    whether each is inside."""
    inside = (targets >= start) & (targets < start + size)
    return torch.where(inside, targets - start, torch.zeros_like(targets)).long(), inside


def _block_grad(first: int, x: torch.Tensor, weight: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor,
                grad_loss: torch.Tensor, start: int) -> torch.Tensor:
    """The gradient of a block's logits (its rows from ``first``) in the activations' dtype: the softmax, recomputed
    from the logits and the forward's log-sum-exp, less the target's one-hot on the rank whose shard holds it, times
    the loss's gradient (megatron-core's ``vocab_parallel_cross_entropy`` backward)."""
    grad = torch.exp(_block_logits(x, weight) - lse.unsqueeze(1))
    local, inside = _local_targets(targets.long(), start, weight.shape[0])
    grad.scatter_add_(1, local.unsqueeze(1), -inside.float().unsqueeze(1))
    return (grad * grad_loss.unsqueeze(1)).to(x.dtype)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``apply(hidden [s, b, h], weight [V / tp, h], labels [s, b], block, tp_group, sequence_parallel)`` -> per-token
    fp32 loss ``[s, b]`` (``s`` all the tensor-parallel group's tokens under ``sequence_parallel``)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, block, tp_group, sequence_parallel):
        tp = tp_group.size() if tp_group is not None else 1
        full = _gather_tokens(hidden, tp_group) if sequence_parallel and tp > 1 else hidden
        s, b, h = full.shape
        x, targets = full.reshape(s * b, h), labels.reshape(-1)
        start = (tp_group.rank() if tp > 1 else 0) * weight.shape[0]
        lse = torch.empty(s * b, dtype=torch.float32, device=full.device)
        loss = torch.empty_like(lse)
        for first in range(0, s * b, block):
            rows = slice(first, min(first + block, s * b))
            logits = _block_logits(x[rows], weight)
            peak = logits.max(dim=-1).values
            if tp > 1:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp_group)
            local, inside = _local_targets(targets[rows], start, weight.shape[0])
            picked = (logits.gather(1, local.unsqueeze(1)).squeeze(1) - peak).masked_fill(~inside, 0.0)
            stats = torch.stack((picked, torch.exp(logits - peak.unsqueeze(1)).sum(dim=-1)))
            if tp > 1:
                dist.all_reduce(stats, group=tp_group)
            lse[rows] = peak + torch.log(stats[1])
            loss[rows] = torch.log(stats[1]) - stats[0]
        ctx.save_for_backward(hidden, weight, targets.to(torch.int32), lse)
        ctx.block, ctx.tp_group, ctx.sequence_parallel, ctx.start = block, tp_group, sequence_parallel and tp > 1, start
        return loss.view(s, b)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse = ctx.saved_tensors
        tp_group = ctx.tp_group
        full = _gather_tokens(hidden, tp_group) if ctx.sequence_parallel else hidden
        s, b, h = full.shape
        x, grad_loss = full.reshape(s * b, h), grad_loss.reshape(-1).float()
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        for first in range(0, s * b, ctx.block):
            rows = slice(first, min(first + ctx.block, s * b))
            grad = _block_grad(first, x[rows], weight, lse[rows], targets[rows], grad_loss[rows], ctx.start)
            if grad_x is not None:
                grad_x[rows] = torch.matmul(grad, weight)
            if grad_w is not None:
                grad_w.addmm_(grad.t().float(), x[rows].float())
        if grad_x is not None:
            grad_x = _reduce_hidden_grad(grad_x.view(s, b, h), tp_group, ctx.sequence_parallel)
        return grad_x, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def _reduce_hidden_grad(grad: torch.Tensor, tp_group, sequence_parallel: bool) -> torch.Tensor:
    """The hidden states' gradient summed over the tensor-parallel ranks (each has its vocabulary shard's share):
    reduce-scattered to this rank's tokens under sequence parallelism, else all-reduced (megatron-core's
    ``copy_to_tensor_model_parallel_region`` in backward)."""
    if tp_group is None or tp_group.size() == 1:
        return grad
    if sequence_parallel:
        out = grad.new_empty((grad.shape[0] // tp_group.size(), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=tp_group)
        return out
    dist.all_reduce(grad, group=tp_group)
    return grad


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, block: int,
                                 tp_group=None, sequence_parallel: bool = False) -> torch.Tensor:
    """Per-token fp32 loss ``[s, b]`` of the output layer ``weight`` on ``hidden`` ``[s, b, h]`` against ``labels``
    ``[s, b]``, in blocks of ``block`` tokens (:class:`ChunkedLinearCrossEntropy`)."""
    if block < 1:
        raise ValueError(f"chunked_linear_cross_entropy: block of {block} tokens; give at least 1")
    return ChunkedLinearCrossEntropy.apply(hidden, weight, labels, block, tp_group, sequence_parallel)
