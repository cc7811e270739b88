"""The fused kernels of :mod:`megatron_epp.executor.fused` plugged into megatron-core's layer spec: a
``ModuleSpec`` submodule each, never a patch of megatron-core.

- norm: :class:`FusedNorm` as the layer's ``input_layernorm``/``pre_mlp_layernorm`` (and the query/key norms and the
  final norm), an ``RMSNorm`` with the same parameter (``weight``), so checkpoints do not change. The residual add
  stays apart: megatron-core's layer adds it in its bias-dropout-add submodule before the norm sees its input, and
  the spec has no place where the norm receives both.
- swiglu: :class:`FusedSwiGLUMLP` as the layer's ``mlp`` module (megatron-core's ``MLP``, its activation the kernel).
- rope: the elastic ``ChunkRopeSelfAttention``'s ``rope_backend`` (``ModuleSpec.params``).
- the tiled MLP (``--epp-mlp-chunk-tokens``): :func:`tiled_mlp_spec` makes the layer's ``mlp`` module a
  :class:`TiledMLP` (over megatron-core's ``MLP``) or :class:`TiledFusedSwiGLUMLP`, the MLP computed in token blocks
  (:mod:`megatron_epp.executor.tiled_mlp`); same parameters, so checkpoints do not change.
- cross entropy: :class:`FusedLossGPTModel`, megatron-core's ``GPTModel`` whose ``compute_language_model_loss`` runs
  the kernel (the output head is not built from the layer spec); :class:`ChunkedLossGPTModel` (``--epp-loss-chunk-tokens``)
  computes the output layer and the loss together in token blocks instead, the logits never whole.

With every op on ``torch`` (the CPU's default) :func:`fused_layer_spec` returns the spec it is given, the same
object, and the model is megatron-core's ``GPTModel``: exactly today's modules.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_epp.executor import fused
from megatron_epp.executor.chunked_loss import chunked_linear_cross_entropy
from megatron_epp.executor.rotary import ChunkRopeSelfAttention
from megatron_epp.executor.tiled_mlp import tiled_mlp


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` run by a fused kernel (``backend``); ``offset`` 1 for a zero-centred weight
    (``--apply-layernorm-1p``: the weight initialised to 0, scaled by ``1 + weight``)."""

    def __init__(self, hidden_size: int, eps: float, backend: str, offset: float = 0.0) -> None:
        super().__init__(hidden_size, eps=eps)
        self.backend, self.offset = backend, offset
        self._kernel = fused.kernel("norm", backend)
        if offset:
            torch.nn.init.zeros_(self.weight)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "offset", 0.0):
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self.weight, self.eps, self.offset)


class FusedNorm:
    """The spec's norm submodule (``ModuleSpec(module=FusedNorm, params={"backend": ...})``): a
    :class:`FusedRMSNorm`, its weight tagged ``sequence_parallel`` as ``TorchNorm`` tags it (each tensor-parallel rank
    normalises its own tokens under ``--sequence-parallel``)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, backend: str = "compile", **kwargs) -> torch.nn.Module:
        if config.normalization != "RMSNorm":
            raise ValueError(f"FusedNorm is RMSNorm's; the config's normalization is {config.normalization}")
        norm = FusedRMSNorm(hidden_size, eps, backend, offset=1.0 if config.layernorm_zero_centered_gamma else 0.0)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class FusedSwiGLUMLP(MLP):
    """megatron-core's ``MLP`` whose gated SiLU is a fused kernel (``swiglu_backend``), the fc1 bias (if any) added
    first as megatron-core's unfused path adds it; what it does not cover (per-token scales, clamped or offset
    GLUs) goes to megatron-core's ``forward``."""

    def __init__(self, *args, swiglu_backend: str = "compile", **kwargs) -> None:
        # megatron-core's layer hands tp_group to an MLP spec of MLP only: without it MLP takes megatron-core's
        # tensor-parallel group, which is the run's (model.runtime.process_groups: use_mpu_process_groups)
        super().__init__(*args, **kwargs)
        self.swiglu_backend = swiglu_backend
        self._swiglu = fused.kernel("swiglu", swiglu_backend)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        config = self.config
        if (per_token_scale is not None or not config.gated_linear_unit or config.activation_func_clamp_value is not None
                or config.glu_linear_offset != 0.0 or config.use_te_activation_func):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(self._swiglu(intermediate))


class _Tiled:
    """The MLP of the class it is mixed into, computed in blocks of ``mlp_chunk_tokens`` of its input's rows
    (:func:`~megatron_epp.executor.tiled_mlp.tiled_mlp`) where autograd records it (training): its backward recomputes
    each block. The output bias megatron-core returns apart (``skip_bias_add``: the fc2 bias itself) is returned as
    the whole MLP returns it. Without autograd, or with per-token scales, the MLP as it is."""

    def __init__(self, *args, mlp_chunk_tokens: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if mlp_chunk_tokens < 1:
            raise ValueError(f"{type(self).__name__}: mlp_chunk_tokens {mlp_chunk_tokens}; give at least 1")
        self.mlp_chunk_tokens = mlp_chunk_tokens

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        whole = super().forward
        if per_token_scale is not None or not torch.is_grad_enabled():
            return whole(hidden_states, per_token_scale, **kwargs)
        bias: list = []

        def run(block: torch.Tensor) -> torch.Tensor:
            out, out_bias = whole(block, **kwargs)
            bias[:] = [out_bias]
            return out

        params = tuple(p for p in self.parameters() if p.requires_grad)
        return tiled_mlp(hidden_states, self.mlp_chunk_tokens, run, params), bias[0]


class TiledMLP(_Tiled, MLP):
    """megatron-core's ``MLP`` in token blocks (:class:`_Tiled`)."""


class TiledFusedSwiGLUMLP(_Tiled, FusedSwiGLUMLP):
    """:class:`FusedSwiGLUMLP` in token blocks (:class:`_Tiled`)."""


TILED = {MLP: TiledMLP, FusedSwiGLUMLP: TiledFusedSwiGLUMLP}


def tiled_mlp_spec(spec: ModuleSpec, mlp_chunk_tokens: int) -> ModuleSpec:
    """``spec`` (a GPT layer spec, fused or not) with its MLP in blocks of ``mlp_chunk_tokens`` tokens (:class:`_Tiled`);
    ``spec`` itself at 0."""
    if not mlp_chunk_tokens:
        return spec
    spec = copy_spec(spec)
    mlp = spec.submodules.mlp
    if not (isinstance(mlp, ModuleSpec) and mlp.module in TILED):
        raise ValueError(f"tiled_mlp_spec: --epp-mlp-chunk-tokens tiles megatron-core's dense MLP; the layer's is {getattr(mlp, 'module', mlp)}")
    logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_MLP_FILTER)
    mlp.module = TILED[mlp.module]
    mlp.params = {**mlp.params, "mlp_chunk_tokens": mlp_chunk_tokens}
    return spec


class FusedLossGPTModel(GPTModel):
    """megatron-core's ``GPTModel`` whose per-token loss is a fused cross entropy (``cross_entropy_backend``): a
    library's or torch.compile's at TP = 1, megatron-core's fused vocab-parallel one (``--cross-entropy-loss-fusion``'s
    native implementation, its own torch.compile) at TP > 1 under ``compile``."""

    def __init__(self, *args, cross_entropy_backend: str = "compile", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cross_entropy_backend = cross_entropy_backend
        self._cross_entropy = fused.kernel("cross_entropy", cross_entropy_backend)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b], as megatron-core
        if self.pg_collection.tp.size() > 1:
            loss = fused_vocab_parallel_cross_entropy(logits, labels, self.pg_collection.tp)
        else:
            loss = self._cross_entropy(logits, labels)
        return loss.transpose(0, 1).contiguous()


class ChunkedLossGPTModel(GPTModel):
    """megatron-core's ``GPTModel`` whose output head computes the output layer and the cross entropy in blocks of
    ``loss_chunk_tokens`` tokens (``--epp-loss-chunk-tokens``, :mod:`megatron_epp.executor.chunked_loss`): the chunk's
    logits are never whole on the device, the head keeps its input, the targets and a log-sum-exp per token. Only
    ``_postprocess``'s training path (labels given, no multi-token prediction, no inference) is replaced; the output
    weight is megatron-core's (the tied embedding's where it shares it), the per-token loss megatron-core's."""

    def __init__(self, *args, loss_chunk_tokens: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if loss_chunk_tokens < 1:
            raise ValueError(f"ChunkedLossGPTModel: loss_chunk_tokens {loss_chunk_tokens}; give at least 1")
        self.loss_chunk_tokens = loss_chunk_tokens

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                     **kwargs):
        if (labels is None or not self.post_process or kwargs.get("mtp_in_postprocess") or self.config.mtp_num_layers is not None
                or kwargs.get("inference_context") is not None):
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                                        rotary_pos_sin, **kwargs)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else self.output_layer.weight
        tp = self.pg_collection.tp
        loss = chunked_linear_cross_entropy(hidden_states, weight, labels.transpose(0, 1).contiguous(), self.loss_chunk_tokens,
                                            tp if tp.size() > 1 else None, self.output_layer.sequence_parallel)
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s], as megatron-core


class _KnownMLP(logging.Filter):
    """Drops megatron-core's "Unknown MLP type" warning, which its layer logs for any ``ModuleSpec`` MLP but
    megatron-core's own (here :class:`FusedSwiGLUMLP`, built with the same tensor-parallel group)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type: <class 'megatron.core.transformer.spec_utils.ModuleSpec'>")


_MLP_FILTER = _KnownMLP()


def _is_norm(module) -> bool:
    """A norm the fused one replaces: megatron-epp's ``TorchNorm`` or megatron-core's ``WrappedTorchNorm`` (by name:
    ``TorchNorm`` lives in :mod:`megatron_epp.model.gpt`, which imports this module)."""
    return isinstance(module, type) and module.__name__ in ("TorchNorm", "WrappedTorchNorm")


def fused_norm_spec(backend: str) -> ModuleSpec:
    return ModuleSpec(module=FusedNorm, params={"backend": backend})


def copy_spec(spec: ModuleSpec) -> ModuleSpec:
    """A copy of ``spec``'s tree (specs and submodule records) whose ``params`` values are the same objects: the
    elastic spec's :class:`~megatron_epp.executor.context.ChunkContext` stays the one the model reads."""
    memo: dict[int, object] = {}

    def keep(node) -> None:
        if isinstance(node, ModuleSpec):
            memo.update({id(value): value for value in node.params.values()})
            keep(node.submodules)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for item in dataclasses.fields(node):
                keep(getattr(node, item.name))

    keep(spec)
    return copy.deepcopy(spec, memo)


def fused_layer_spec(spec: ModuleSpec, choice: fused.FusedChoice) -> ModuleSpec:
    """``spec`` (a local or elastic GPT layer spec) with the fused submodules of ``choice``; ``spec`` itself when it
    fuses nothing in the layer (the cross entropy is the model's: :class:`FusedLossGPTModel`)."""
    if (choice.norm, choice.swiglu, choice.rope) == ("torch", "torch", "torch"):
        return spec
    spec = copy_spec(spec)
    layer, attention = spec.submodules, spec.submodules.self_attention
    if choice.norm != "torch":
        for owner, name in ((layer, "input_layernorm"), (layer, "pre_mlp_layernorm"),
                            (attention.submodules, "q_layernorm"), (attention.submodules, "k_layernorm")):
            if _is_norm(getattr(owner, name, None)):
                setattr(owner, name, fused_norm_spec(choice.norm))
    if choice.swiglu != "torch":
        if not (isinstance(layer.mlp, ModuleSpec) and layer.mlp.module is MLP):
            raise ValueError("fused_layer_spec: the swiglu kernel replaces megatron-core's MLP, the spec has another")
        logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_MLP_FILTER)  # once: the same filter
        layer.mlp.module = FusedSwiGLUMLP
        layer.mlp.params = {**layer.mlp.params, "swiglu_backend": choice.swiglu}
    if choice.rope != "torch":
        if not issubclass(attention.module, ChunkRopeSelfAttention):
            raise ValueError("fused_layer_spec: the rope kernel is the elastic layers' (ChunkRopeSelfAttention)")
        attention.params = {**attention.params, "rope_backend": choice.rope}
    return spec
