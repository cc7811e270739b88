"""Per-chunk batches of a Plan, the GPT forward step for elastic chunks, and the per-token loss."""

from __future__ import annotations

from functools import partial
from typing import Iterator, Sequence

import torch

from megatron_epp.executor.context import ChunkContext
from megatron_epp.plan import Plan

Batch = dict[str, torch.Tensor]
TokensAndLabels = tuple[torch.Tensor, torch.Tensor]


def per_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Sum of masked token losses, the token count, and both for logging (``calculate_per_token_loss``)."""
    mask = loss_mask.reshape(-1).float()
    loss = (output_tensor.float().reshape(-1) * mask).sum()
    count = mask.sum()
    return loss, count.int(), {"lm loss": torch.stack([loss.detach(), count.detach()])}


def chunk_batches(plan: Plan, sequences: Sequence[TokensAndLabels] | None, device: torch.device) -> Iterator[Batch]:
    """One batch ``[1, tokens]`` per chunk in forward order; empty dicts where the stage has no data."""
    for chunk in plan.chunks():
        if sequences is None:
            yield {}
            continue
        tokens = torch.cat([sequences[s.seq][0][s.start : s.end] for s in chunk.segments])
        labels = torch.cat([sequences[s.seq][1][s.start : s.end] for s in chunk.segments])
        yield {
            "tokens": tokens[None].to(device),
            "labels": labels[None].to(device),
            "loss_mask": torch.ones(1, tokens.numel(), device=device),
        }


def elastic_gpt_forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module):
    """``forward_step_func`` for elastic chunks: positions come from the plan (the model's current
    chunk), tokens from the batch."""
    batch = next(data_iterator)
    positions = ChunkContext.of(model).layout().position_ids[None]
    output = model(batch.get("tokens"), positions, None, labels=batch.get("labels"))
    return output, partial(per_token_loss, batch.get("loss_mask"))
