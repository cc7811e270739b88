"""A decoder-only transformer's shape (:class:`ModelShape`), its parameter and FLOP counts, how context parallelism
divides its heads, and the model presets (the published LLaMA shapes, the project's CPU test model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # activation dtypes the saved-tensor count is measured in


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (LLaMA-style: SwiGLU MLP, untied output layer).

    ``num_kv_heads``: K/V heads (grouped-query attention; None: ``num_heads``); ``kv_channels``: the
    head dimension (None: ``hidden / num_heads``); ``normalization``: ``LayerNorm`` or ``RMSNorm``;
    ``bias``: the linear layers have biases (``--disable-bias-linear``: False).
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    ffn_hidden: int
    vocab: int
    num_kv_heads: int | None = None
    swiglu: bool = True
    rope: bool = True  # rotary positions (False: learned absolute positions); changes what attention saves
    dtype: str = "float32"  # the activations' dtype (DTYPE_BYTES): what autograd saves and the K/V buffers hold
    kv_channels: int | None = None
    normalization: str = "LayerNorm"
    bias: bool = True
    # biases on the QKV linear layer alone (``--add-qkv-bias`` with ``--disable-bias-linear``: Qwen2), and a norm
    # over each head's query and key (``--qk-layernorm``: Qwen3), one weight of ``head_dim`` shared by the heads
    qkv_bias: bool = False
    qk_norm: bool = False
    # parameters beyond the layers' weights, counted by ``rank_parameters`` (model states): one embedding table
    # shared with the output layer, and the rows of a learned position table (0: none, RoPE)
    tied_embeddings: bool = False
    learned_positions: int = 0
    # dropout probabilities in training (``--hidden-dropout``, ``--attention-dropout``): what the dropouts save
    # (their masks; on CPU attention dropout takes SDPA's math path) is counted by the memory derivations
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # the output head in blocks of this many tokens (``--epp-loss-chunk-tokens``; 0: the whole chunk's logits): what
    # the head keeps for its backward (the memory derivations' ``logits_token``) and its backward's recomputed logits
    loss_chunk_tokens: int = 0
    # every layer's MLP in blocks of this many of a rank's tokens (``--epp-mlp-chunk-tokens``; 0: the whole chunk's): what
    # a layer keeps for its backward (only the MLP's input) and its backward's recomputed MLP forward
    mlp_chunk_tokens: int = 0

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.num_heads

    @property
    def q_hidden(self) -> int:
        """The queries' (and the attention output's) width: ``heads x head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_hidden(self) -> int:
        """The keys' (or values') width: ``kv_heads x head_dim``."""
        return (self.num_kv_heads or self.num_heads) * self.head_dim

    def gemm_params_per_layer(self) -> int:
        """Weights of the layer's GEMMs: QKV, output projection, MLP (fc1 twice as wide with SwiGLU)."""
        h = self.hidden
        return h * (self.q_hidden + 2 * self.kv_hidden) + self.q_hidden * h + (3 if self.swiglu else 2) * h * self.ffn_hidden

    @property
    def norm_params(self) -> int:
        """One norm's parameters: a weight, and a bias for LayerNorm."""
        return (2 if self.normalization == "LayerNorm" else 1) * self.hidden

    @property
    def qk_norm_params(self) -> int:
        """The query and key norms' parameters of a layer (``qk_norm``): a weight (and a bias for LayerNorm) of
        ``head_dim`` each, whole on every tensor-parallel rank."""
        return 2 * (2 if self.normalization == "LayerNorm" else 1) * self.head_dim if self.qk_norm else 0

    def params_per_layer(self) -> int:
        """Every parameter of a layer: GEMM weights, two norms, biases."""
        h, f = self.hidden, self.ffn_hidden
        norms = 2 * self.norm_params
        biases = (self.q_hidden + 2 * self.kv_hidden + h + (2 if self.swiglu else 1) * f + h) if self.bias else 0
        qkv_biases = self.q_hidden + 2 * self.kv_hidden if self.qkv_bias and not self.bias else 0
        return self.gemm_params_per_layer() + norms + biases + qkv_biases + self.qk_norm_params

    def rank_parameters(self, layers_per_stage: Sequence[int], tp: int) -> np.ndarray:
        """Parameters one tensor-parallel rank of each pipeline stage holds, exactly as Megatron-Core's GPTModel
        builds them: the column/row-parallel weights, the column-parallel biases and the vocabulary split by
        ``tp``; norms, row-parallel biases and learned positions whole on every rank. The first stage holds the
        embedding (and positions), the last the final norm and the output layer (the embedding itself when tied
        on one stage; a copy of it on the last stage when tied across stages)."""
        h, q, kv, f, b = self.hidden, self.q_hidden, self.kv_hidden, self.ffn_hidden, int(self.bias)
        fc1 = (2 if self.swiglu else 1) * f
        qkv_b = int(self.bias or self.qkv_bias)
        split = h * (q + 2 * kv) + q * h + h * fc1 + f * h + qkv_b * (q + 2 * kv) + b * fc1  # QKV, proj, fc1, fc2 (+ biases)
        whole = 2 * self.norm_params + b * 2 * h + self.qk_norm_params  # two norms, proj and fc2 biases, query and key norms
        params = np.asarray(layers_per_stage, dtype=float) * (split / tp + whole)
        params[0] += self.vocab * h / tp + self.learned_positions * h
        params[-1] += self.norm_params + (0 if self.tied_embeddings and len(params) == 1 else self.vocab * h / tp)
        return params

    def gemm_flops_per_token(self) -> float:
        """Forward GEMM FLOPs of one layer per token (2 per multiply-add)."""
        return 2.0 * self.gemm_params_per_layer()

    def mlp_gemm_flops_per_token(self) -> float:
        """Forward GEMM FLOPs of one layer's MLP per token (fc1, twice as wide with SwiGLU, and fc2)."""
        return 2.0 * (3 if self.swiglu else 2) * self.hidden * self.ffn_hidden

    def training_flops(self, seq_lengths) -> float:
        """Model FLOPs of one training pass (forward + backward = 3 x forward; recompute not counted) over causal
        sequences of ``seq_lengths`` tokens, each attending only to itself: per layer the GEMMs per token and,
        per sequence of ``n`` tokens, ``n (n + 1) / 2`` query-key pairs at ``4 heads x head_dim`` FLOPs each (``Q K^T`` and
        ``P V``); the output layer ``2 h V`` per token. A sequence cut into slices has the same pairs (each
        slice's queries attend to the slices before it and causally to itself), so it counts as the whole."""
        n = np.asarray(seq_lengths, dtype=np.float64)
        tokens, pairs = n.sum(), (n * (n + 1) / 2).sum()
        layer = self.gemm_flops_per_token() * tokens + 4.0 * self.q_hidden * pairs
        return 3.0 * (self.num_layers * layer + 2.0 * self.hidden * self.vocab * tokens)


def kv_heads_split(shape: ModelShape, tp: int, cp: int) -> bool:
    """Whether context parallelism of size ``cp`` splits the K/V heads of a tensor-parallel rank (``cp`` divides them:
    each CP rank holds ``1 / cp`` of them after the all-to-all) rather than replicating them (every CP rank holds all
    of the TP rank's K/V heads, gathered over the CP group: grouped-query attention with fewer K/V heads than ``cp``)."""
    return cp == 1 or ((shape.num_kv_heads or shape.num_heads) / tp) % cp == 0


def check_context_parallel(shape: ModelShape, tp: int, cp: int) -> None:
    """A one-line ``ValueError`` unless ``cp`` (>= 1) divides the attention heads of a tensor-parallel rank."""
    heads = shape.num_heads / tp
    if cp < 1 or (cp > 1 and heads % cp):
        raise ValueError(f"--context-parallel-size {cp}: must divide the {heads:g} attention heads per tensor-parallel rank "
                         f"({shape.num_heads} heads, TP={tp})")


_LLAMA = {"normalization": "RMSNorm", "bias": False}  # and SwiGLU, RoPE: ModelShape's defaults
# Published LLaMA shapes (LLaMA-1 paper, table 2; "30B" is the 32.5B model), trained in bf16.
MODEL_PRESETS: dict[str, ModelShape] = {
    "llama-7b": ModelShape("llama-7b", 32, 4096, 32, 11008, 32000, dtype="bfloat16", **_LLAMA),
    "llama-13b": ModelShape("llama-13b", 40, 5120, 40, 13824, 32000, dtype="bfloat16", **_LLAMA),
    "llama-30b": ModelShape("llama-30b", 60, 6656, 52, 17920, 32000, dtype="bfloat16", **_LLAMA),
}

# The CPU test model of the project (fp32, one thread): GPT-style GELU MLP, 8 layers.
TEST_MODEL = ModelShape("test-model", 8, 64, 4, 256, 512, swiglu=False)
