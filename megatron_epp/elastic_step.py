"""Per-chunk batches of a Plan and the GPT forward step for elastic chunks."""

from __future__ import annotations

from functools import partial
from typing import Iterator, Sequence

import torch

from megatron_epp.model.chunk_state import CHUNK_STATE
from megatron_epp.plan import Plan
from megatron_epp.training.gpt_step import Batch, per_token_loss

TokensAndLabels = tuple[torch.Tensor, torch.Tensor]


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
    """``forward_step_func`` for elastic chunks: positions come from the plan, tokens from the batch."""
    batch = next(data_iterator)
    positions = CHUNK_STATE.layout().position_ids[None]
    output = model(batch.get("tokens"), positions, None, labels=batch.get("labels"))
    return output, partial(per_token_loss, batch.get("loss_mask"))
