"""Micro-batches of fixed-length GPT samples and the forward step / per-token loss of Megatron's GPT."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from megatron_epp.executor.batches import Batch, per_token_loss

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def collate(samples: Sequence[Mapping[str, Any]], device: torch.device) -> Batch:
    out: Batch = {}
    for key in BATCH_KEYS:
        stacked = torch.stack([torch.as_tensor(s[key]) for s in samples])
        out[key] = stacked.to(device, torch.float32 if key == "loss_mask" else torch.int64)
    return out


def microbatches(
    samples: Sequence[Mapping[str, Any]],
    consumed_samples: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
) -> Iterator[Batch]:
    """This data-parallel rank's micro-batches, step after step, from ``consumed_samples`` on.

    Global batch ``b`` holds samples ``[b*G, (b+1)*G)``; dp rank ``r`` takes the ``r``-th contiguous
    share. Indices wrap around the dataset (epochs).
    """
    per_rank = global_batch_size // dp_size
    start = consumed_samples
    while True:
        base = start + dp_rank * per_rank
        for m in range(0, per_rank, micro_batch_size):
            ids = [(base + m + j) % len(samples) for j in range(micro_batch_size)]
            yield collate([samples[i] for i in ids], device)
        start += global_batch_size


def gpt_forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
    """Megatron-Core ``forward_step_func``: run the stage, return its output and the loss function."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(per_token_loss, batch["loss_mask"])


def reduce_losses(losses: list[dict[str, torch.Tensor]], dp_group: Any) -> float | None:
    """Global-batch mean token loss from the last stage's per-micro-batch ``[sum, count]``; None elsewhere. ``dp_group``:
    the data-parallel group with context parallelism (each context-parallel rank's sums are of its own tokens). A global
    batch without a trained token (``--sft``: conversations cut before any assistant token) has loss 0, as its gradient."""
    if not losses:
        return None
    total = torch.stack([d["lm loss"] for d in losses]).sum(0).double()
    torch.distributed.all_reduce(total, group=dp_group)
    return float(total[0] / total[1]) if total[1] > 0 else 0.0
