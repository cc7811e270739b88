"""A stage's inputs for a Plan built ahead (per-chunk views and batches), the GPT forward step
for elastic chunks, and the per-token loss."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator, Sequence

import torch

from megatron_epp.executor.context import ChunkContext, ChunkView, padding_tokens, sequence_slices, to_device
from megatron_epp.plan import Plan

Batch = dict[str, torch.Tensor]
# a sequence's tokens and labels, and optionally its labels' loss mask (--sft: 1 where the label trains; without it, all)
TokensAndLabels = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def per_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Sum of masked token losses, the token count, and both for logging (``calculate_per_token_loss``)."""
    mask = loss_mask.reshape(-1).float()
    loss = (output_tensor.float().reshape(-1) * mask).sum()
    count = mask.sum()
    return loss, count.int(), {"lm loss": torch.stack([loss.detach(), count.detach()])}


def chunk_batches(plan: Plan, sequences: Sequence[TokensAndLabels] | None, device: torch.device, multiple: int = 1,
                  cp_rank: int = 0, cp_size: int = 1) -> Iterator[Batch]:
    """One batch ``[1, tokens]`` per chunk in forward order; empty dicts where the stage has no data.
    ``sequences``: CPU tensors (on CUDA the batches go from pinned memory without blocking); a sequence's third tensor,
    where given, is its labels' loss mask, and each segment (a split slice, a hybrid chunk's part) keeps its tokens'.
    ``multiple``: as ``ChunkView.build``'s; the padding tokens are token 0 with label 0 and loss mask 0. Under context
    parallelism only context-parallel rank ``cp_rank``'s block of each padded chunk (``ChunkView.local_range``)."""
    for chunk in plan.chunks():
        if sequences is None:
            yield {}
            continue
        pad = torch.zeros(padding_tokens(chunk.num_tokens, multiple), dtype=sequences[0][0].dtype)
        tokens = torch.cat([sequences[s.seq][0][s.start : s.end] for s in chunk.segments] + [pad])
        labels = torch.cat([sequences[s.seq][1][s.start : s.end] for s in chunk.segments] + [pad])
        if any(len(sequences[s.seq]) > 2 for s in chunk.segments):
            masks = [sequences[s.seq][2][s.start : s.end].float() if len(sequences[s.seq]) > 2 else torch.ones(s.end - s.start)
                     for s in chunk.segments]
            loss_mask = torch.cat(masks + [torch.zeros(pad.numel())])[None]
        else:  # every token trains
            loss_mask = torch.ones(1, tokens.numel())
            loss_mask[:, chunk.num_tokens :] = 0
        if cp_size > 1:
            # this rank's block in storages of its own: a view would keep the whole chunk's, and autograd saves them
            # (the embedding its ids, the loss its mask: 12 B a local token the memory model does not count)
            share = tokens.numel() // cp_size
            mine = slice(cp_rank * share, (cp_rank + 1) * share)
            tokens, labels, loss_mask = (t[..., mine].clone() for t in (tokens, labels, loss_mask))
        yield {
            "tokens": to_device(tokens[None], device),
            "labels": to_device(labels[None], device),
            "loss_mask": to_device(loss_mask, device),
        }


@dataclass
class StepInputs:
    """Everything one stage needs per chunk of a plan that does not depend on activations: the
    chunks' views (positions, packing, prefix, recompute count) and batches, built from the plan
    on the host ahead of the schedule (the training driver builds the next step's while this one
    trains), so the schedule's per-chunk work is the kernels and the transfers."""

    plan: Plan
    stage: int
    views: list[list[ChunkView]]  # [pipeline][chunk], what forward_backward_elastic takes as views=
    batches: list[Batch]  # one per chunk in forward order (the data iterator's items)


def prepare_step(plan: Plan, stage: int, sequences: Sequence[TokensAndLabels] | None, device: torch.device,
                 multiple: int = 1, cp_rank: int = 0, cp_size: int = 1) -> StepInputs:
    """``stage``'s :class:`StepInputs` for ``plan`` on ``device``, every chunk padded to a multiple of
    ``multiple`` tokens (``token_multiple(config)``: sequence and context parallelism); context-parallel rank
    ``cp_rank`` of ``cp_size`` gets its block of each chunk."""
    views = [
        [ChunkView.build(c, plan.seq_lengths, device, recompute=count, multiple=multiple, cp_rank=cp_rank, cp_size=cp_size,
                         offload=off, slices=slices, kv_host=set(pipe.kv_host))
         for c, count, off in zip(pipe.chunks, pipe.recompute[stage], pipe.offloaded(stage))]
        for pipe in plan.pipelines for slices in [sequence_slices(pipe.chunks, plan.seq_lengths)]
    ]
    return StepInputs(plan, stage, views, list(chunk_batches(plan, sequences, device, multiple, cp_rank, cp_size)))


def elastic_gpt_forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module):
    """``forward_step_func`` for elastic chunks: positions come from the plan (the model's current
    chunk: this context-parallel rank's tokens'), tokens from the batch."""
    batch = next(data_iterator)
    positions = ChunkContext.of(model).view().local_position_ids[None]
    output = model(batch.get("tokens"), positions, None, labels=batch.get("labels"))
    return output, partial(per_token_loss, batch.get("loss_mask"))
