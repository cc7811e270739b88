"""The layers' MLP in token blocks (``--epp-mlp-chunk-tokens``): a long chunk's MLP activations are never whole on the
device (the sequence-tiled MLP of ALST, Snowflake 2025, for documents of millions of tokens).

:class:`TiledMLPFunction` runs the MLP (megatron-core's ``MLP`` or the fused SwiGLU one, whatever ``run`` calls) over
blocks of ``block`` rows of its input (``[s, b, h]``, blocks along ``s``: this rank's tokens, its sequence-parallel
shard under sequence parallelism, whose fc1 gathers every tensor-parallel rank's same block and whose fc2
reduce-scatters it back: the MLP is token-wise, so the blocks are independent) without autograd, and keeps only its
input for backward: ``b h / sp`` bytes a token, which megatron-core's fc1 keeps anyway, where the whole MLP kept fc1's
output, the activation's tensors and fc2's input (``5 b f`` a token with SwiGLU, ``2 b f`` with GELU). Its backward
recomputes each block's MLP with autograd and takes that block's gradients at once: the input's, and the parameters'
summed over the blocks in fp32 and cast to the parameters' dtype once (as the chunked head does), returned to
autograd, which accumulates them as for any other use of the weights. The backward thus costs one more MLP forward.

A block's recomputed activations and gradients are the backward's workspace (``block`` rows of them, freed before the
next block), not activations the step's graph saves: they are recomputed under pass-through saved-tensor hooks, so
the CPU count of saved tensors (``executor.memory_tracker``) leaves them out as it leaves out gradients, and the
planner's memory model counts them where the allocator is measured (``bwd_workspace``). Plain torch: CPU and GPU
alike. Equal to the untiled MLP within fp32 rounding, not bitwise (the weight gradients' block-wise sums round in
another order).
"""

from __future__ import annotations

from typing import Callable

import torch


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _blocks(rows: int, block: int) -> list[slice]:
    return [slice(first, min(first + block, rows)) for first in range(0, rows, block)]


def _block_grads(first: int, run, xb: torch.Tensor, params: tuple[torch.Tensor, ...], grad: torch.Tensor) -> tuple:
    """The gradients of one block (its rows from ``first``): its input's and each parameter's (None: unused)."""
    xb = xb.detach().requires_grad_(True)
    return torch.autograd.grad(run(xb), (xb, *params), grad, allow_unused=True)


class TiledMLPFunction(torch.autograd.Function):
    """``apply(x [s, b, h], block, run, *params)`` -> ``run``'s output ``[s, b, h]``, computed block by block of
    ``block`` rows of ``x``; ``run(x_block)`` is the MLP's forward on a block (its output tensor) and ``params`` the
    parameters it uses that take gradients."""

    @staticmethod
    def forward(ctx, x, block, run, *params):
        with torch.no_grad():
            out = torch.cat([run(x[rows]) for rows in _blocks(x.shape[0], block)])
        ctx.save_for_backward(x, *params)
        ctx.block, ctx.run = block, run
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        grads: list[torch.Tensor | None] = [None] * len(params)  # fp32 sums over the blocks; None: the parameter unused
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):  # workspace (module doc)
            for rows in _blocks(x.shape[0], ctx.block):
                got = _block_grads(rows.start, ctx.run, x[rows], tuple(params), grad_out[rows])
                grad_x[rows] = got[0]
                grads = [s if g is None else g.float() if s is None else s + g for s, g in zip(grads, got[1:])]
        return (grad_x, None, None, *(None if g is None else g.to(p.dtype) for g, p in zip(grads, params)))


def tiled_mlp(x: torch.Tensor, block: int, run: Callable[[torch.Tensor], torch.Tensor], params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``run`` (an MLP's forward on a block of rows, its output tensor) over ``x`` in blocks of ``block`` rows, keeping
    only ``x`` for backward (:class:`TiledMLPFunction`); ``params``: the parameters ``run`` uses that take gradients."""
    if block < 1:
        raise ValueError(f"tiled_mlp: blocks of {block} tokens; give at least 1")
    return TiledMLPFunction.apply(x, block, run, *params)
