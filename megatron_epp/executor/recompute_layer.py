"""Stage-aware chunk-level recompute: a TransformerLayer that checkpoints itself when the plan says so.

The plan gives, per (stage, chunk), how many of the stage's layers recompute their activations in
backward. For a count ``c`` the stage's first ``c`` layers recompute (local indices ``0..c-1``): the
choice is deterministic, so the planner's memory model and the runtime agree. The checkpoint is
megatron-core's ``tensor_parallel.checkpoint`` (dropout RNG restored); the block-level config
recompute stays off in elastic mode. A slice writes its K/V into its sequence's buffer once
(``KVBuffer`` keeps the first write), so a recompute neither rewrites nor double-counts them. Of a chunk's
checkpointed layers the first ``view.offload`` keep their checkpoint in host memory (:mod:`.offload`).
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_epp.executor.context import ChunkContext


class ChunkRecomputeLayer(TransformerLayer):
    """``spec.module`` for elastic stages: recomputes when ``local index < current chunk's count``
    (the chunk of ``context``, given by the layer spec's ``params``)."""

    def __init__(self, *args, context: ChunkContext, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.context = context

    @property
    def local_index(self) -> int:
        per_stage = self.config.num_layers // self.config.pipeline_model_parallel_size
        return (self.layer_number - 1) % per_stage

    def forward(self, *args, **kwargs):
        view = self.context.current
        if view is None or not self.training or self.local_index >= view.recompute:
            return super().forward(*args, **kwargs)
        hidden_states = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        rest = args[1:] if "hidden_states" not in kwargs and args else args
        hooks = None
        if view.offload:  # the first ``offload`` checkpointed layers keep their checkpoint on the host
            chunk = view.per_pass("offload", lambda: [None] * view.recompute)
            offload = self.context.offloader(hidden_states.device)
            hooks = offload.hooks(chunk, self.local_index, self.local_index < view.offload, hidden_states)

        def run(h):
            if not torch.is_grad_enabled():  # the checkpoint's first forward runs without autograd
                output = super(ChunkRecomputeLayer, self).forward(h, *rest, **kwargs)[0]
                if hooks is not None:
                    hooks.armed = True  # what the checkpoint saves next is its input
                return output
            self.context.recomputing = True  # the recompute, inside the chunk's backward
            self.context.before_op("R", self.context.view())
            output = super(ChunkRecomputeLayer, self).forward(h, *rest, **kwargs)[0]
            self.context.recomputing = False
            return output

        if hooks is not None:
            with hooks:
                return tensor_parallel.checkpoint(run, False, hidden_states), None
        return tensor_parallel.checkpoint(run, False, hidden_states), None
