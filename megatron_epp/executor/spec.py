"""The elastic layer spec and the GPTModel hooks that make a stage run elastic chunks."""

from __future__ import annotations

import copy

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_epp.executor.attention import ElasticAttention
from megatron_epp.executor.recompute_layer import ChunkRecomputeLayer
from megatron_epp.executor.rotary import ChunkRotaryEmbedding


def elastic_layer_spec(base: ModuleSpec) -> ModuleSpec:
    """``base`` (a GPT layer spec) with :class:`ElasticAttention` as its core attention and
    :class:`ChunkRecomputeLayer` as its module (per-chunk recompute from the plan)."""
    spec = copy.deepcopy(base)
    spec.module = ChunkRecomputeLayer
    spec.submodules.self_attention.submodules.core_attention = ElasticAttention
    return spec


def install_chunk_positions(model: GPTModel) -> None:
    """Make RoPE follow the current chunk's position ids (learned positions take them directly)."""
    if model.position_embedding_type == "rope":
        model.rotary_pos_emb = ChunkRotaryEmbedding(model.rotary_pos_emb)
