"""The elastic layer spec and the GPTModel hooks that make a stage run elastic chunks.

One :class:`ChunkContext` per model goes to both: ``elastic_layer_spec(base, context)`` before the
model is built, ``install_chunk_context(model, context, seq_length)`` once it is on its device.
"""

from __future__ import annotations

import copy

from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_epp.executor.attention import ElasticAttention
from megatron_epp.executor.context import ChunkContext
from megatron_epp.executor.recompute_layer import ChunkRecomputeLayer
from megatron_epp.executor.rotary import ChunkRopeSelfAttention, ChunkRotaryEmbedding


class GroupRowParallelLinear(RowParallelLinear):
    """megatron-core's ``RowParallelLinear`` that hands its own tensor-parallel group to its GEMM. megatron-core
    0.16.1 passes ``tp_group=None`` there, so every call looks the default group up again and issues a
    ``DeprecationWarning`` (filtered, but made and matched): about 35 us of host time per call on CPU, twice per
    layer forward (output projection, fc2). The group is the same (``self.tp_group`` is that default group)."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


def _own_group_linears(spec: ModuleSpec) -> None:
    """The output projection and fc2 of ``spec`` as :class:`GroupRowParallelLinear` where they are megatron-core's."""
    for owner, name in ((spec.submodules.self_attention.submodules, "linear_proj"), (spec.submodules.mlp.submodules, "linear_fc2")):
        if getattr(owner, name, None) is RowParallelLinear:
            setattr(owner, name, GroupRowParallelLinear)


def elastic_layer_spec(base: ModuleSpec, context: ChunkContext) -> ModuleSpec:
    """``base`` (a GPT layer spec) with :class:`ElasticAttention` as its core attention and
    :class:`ChunkRecomputeLayer` as its module (per-chunk recompute from the plan), both reading
    ``context`` (passed to their constructors through ``ModuleSpec.params``), and
    :class:`ChunkRopeSelfAttention` as its self-attention (RoPE from the chunk's shared tables); its row-parallel
    linears :class:`GroupRowParallelLinear` (less host work per call, the same computation)."""
    spec = copy.deepcopy(base)
    spec.module = ChunkRecomputeLayer
    spec.params = {**spec.params, "context": context}
    if spec.submodules.self_attention.module is not SelfAttention:
        raise ValueError(f"elastic_layer_spec: the base spec's self-attention is {spec.submodules.self_attention.module.__name__}, "
                         "expected megatron-core's SelfAttention (the local spec)")
    spec.submodules.self_attention.module = ChunkRopeSelfAttention
    _own_group_linears(spec)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=ElasticAttention, params={"context": context})
    return spec


def install_chunk_context(model: GPTModel, context: ChunkContext, seq_length: int) -> None:
    """Attach ``context`` to ``model`` (found again by :meth:`ChunkContext.of`) and make RoPE follow
    its current chunk's position ids (learned positions take them directly from the forward step), from one
    table of ``seq_length`` positions (the run's ``--seq-length``: no document is longer) built here, once: call
    this when the model is on its device, before any step."""
    setattr(model, ChunkContext.ATTRIBUTE, context)
    if model.position_embedding_type == "rope":
        model.rotary_pos_emb = ChunkRotaryEmbedding(model.rotary_pos_emb, context, seq_length)
        model.rotary_pos_emb.build_table()
