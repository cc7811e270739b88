"""TransformerConfig, GPTModel for this pipeline stage (cast by Float16Module under ``--bf16``/``--fp16``), and
Megatron-Core's DDP wrapper; which optional GPU kernels (Transformer Engine, fused softmax) it uses."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_epp.base.dims import CP_COMM_TYPE
from megatron_epp.cost.shape import ModelShape
from megatron_epp.executor import fused, kernels
from megatron_epp.executor.context import ChunkContext
from megatron_epp.executor.spec import elastic_layer_spec, install_chunk_context
from megatron_epp.executor.extensions import probe_fused_softmax, probe_transformer_engine
from megatron_epp.model.fused_layers import ChunkedLossGPTModel, FusedLossGPTModel, FusedNorm, fused_layer_spec, tiled_mlp_spec
from megatron_epp.model.runtime import Runtime
from megatron_epp.config.fields import TrainingConfig


def transformer_engine_unavailable() -> str | None:
    """Why Transformer Engine's layers are not used here (None: they are, on the stock path)."""
    return "no CUDA device" if not torch.cuda.is_available() else probe_transformer_engine()


def transformer_engine_available() -> bool:
    return transformer_engine_unavailable() is None


def fused_softmax_unavailable() -> str | None:
    """Why Megatron's fused masked softmax is off here (None: it is on). Without apex or the megatron
    fused kernels, ``masked_softmax_fusion=True`` dies in the first attention on CUDA."""
    return "no CUDA device" if not torch.cuda.is_available() else probe_fused_softmax()


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """``LayerNorm`` scaled by ``1 + weight``, the weight initialised to 0 (``--apply-layernorm-1p``, megatron-core's
    ``layernorm_zero_centered_gamma``, which its ``WrappedTorchNorm`` does not have)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """``RMSNorm`` scaled by ``1 + weight``, the weight initialised to 0 (as :class:`ZeroCenteredLayerNorm`)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class TorchNorm:
    """megatron-core's ``WrappedTorchNorm`` (PyTorch's ``LayerNorm`` or ``RMSNorm``, per ``config.normalization``)
    that also runs under sequence parallelism, where megatron-core's asserts it does not: each tensor-parallel rank
    normalises its own tokens (a norm is per token), and its weight and bias are tagged ``sequence_parallel`` as
    megatron-core's own SP norms tag theirs, so ``finalize_model_grads`` sums their gradients over the
    tensor-parallel group (each rank saw only its share of the tokens). With ``layernorm_zero_centered_gamma``
    (``--apply-layernorm-1p``) the norm is :class:`ZeroCenteredLayerNorm` or :class:`ZeroCenteredRMSNorm`."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs) -> torch.nn.Module:
        unsharded = copy.copy(config)  # a shallow copy: the norm itself is the same with or without SP
        unsharded.sequence_parallel = False
        if config.layernorm_zero_centered_gamma:
            norm_cls = {"LayerNorm": ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}[config.normalization]
            norm = norm_cls(hidden_size, eps=eps)
        else:
            norm = WrappedTorchNorm(unsharded, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def local_layer_spec(normalization: str = "LayerNorm", qk_layernorm: bool = False) -> ModuleSpec:
    """Megatron-Core's local layer spec with :class:`TorchNorm` where it has ``WrappedTorchNorm`` (always with
    RMSNorm; with LayerNorm where apex's fused norm does not import): the local spec under ``--sequence-parallel``.
    ``qk_layernorm`` (``--qk-layernorm``): with the attention's query and key norms, :class:`TorchNorm` as well
    (megatron-core's ``finalize_model_grads`` sums their gradients over the tensor-parallel ranks by name)."""
    spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    attention = spec.submodules.self_attention.submodules
    for owner, name in ((spec.submodules, "input_layernorm"), (spec.submodules, "pre_mlp_layernorm"),
                        (attention, "q_layernorm"), (attention, "k_layernorm")):
        if getattr(owner, name) is WrappedTorchNorm:
            setattr(owner, name, TorchNorm)
    return spec


def decoder_spec(layer: ModuleSpec, config: TransformerConfig) -> ModuleSpec | TransformerBlockSubmodules:
    """What ``GPTModel`` builds its decoder from: for a layer with :class:`TorchNorm` (or a fused norm,
    :class:`~megatron_epp.model.fused_layers.FusedNorm`), this stage's layers and the same norm as the final norm
    (megatron-core's default would be ``WrappedTorchNorm`` here); else ``layer``."""
    norm = layer.submodules.input_layernorm
    if norm is not TorchNorm and not (isinstance(norm, ModuleSpec) and norm.module is FusedNorm):
        return layer
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=norm)


def default_layer_spec(normalization: str = "LayerNorm", local: bool = False, qk_layernorm: bool = False) -> ModuleSpec:
    """The stock path's layers: Transformer Engine's spec when TE's PyTorch layers import on a GPU and ``local`` is
    not asked for (``--attention-backend local``), else the local one (``normalization``: ``LayerNorm`` or
    ``RMSNorm``; TE's layers read it from the ``TransformerConfig``)."""
    if transformer_engine_available() and not local:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return local_layer_spec(normalization, qk_layernorm)


def elastic_base_layer_spec(normalization: str = "LayerNorm", qk_layernorm: bool = False) -> ModuleSpec:
    """The spec ``elastic_layer_spec`` builds elastic layers on: always Megatron-Core's local one.

    Not TE's even where TE imports: ``ElasticAttention`` inside TE's fused layers (TE LayerNormLinear,
    its own RoPE/attention plumbing) is untested, and the planner's memory model counts what the
    local layers save. ``RMSNorm`` is PyTorch's ``torch.nn.RMSNorm`` (:class:`TorchNorm`: megatron-core's
    ``WrappedTorchNorm``, sequence-parallel aware).
    """
    return local_layer_spec(normalization, qk_layernorm)


def layer_spec_summary(elastic: bool, sequence_parallel: int = 0) -> str:
    """One phrase for the start-up line: which layers and softmax this run uses, and why; with ``sequence_parallel``
    (the tensor-parallel size under ``--sequence-parallel``, else 0), how the tokens are split."""
    if elastic:
        spec = "local spec + ElasticAttention"
        if transformer_engine_available():
            spec += " (Transformer Engine imports but is not used with --elastic-pp: the elastic layers and the memory model are the local spec's)"
        if sequence_parallel:
            spec += (f" | sequence parallel over {sequence_parallel} ranks: each chunk padded at its end to a multiple of "
                     f"{sequence_parallel} tokens (a segment of its own, loss mask 0; per step in the plan line)")
        return spec
    return _stock_spec_summary() + (f" | sequence parallel over {sequence_parallel} ranks" if sequence_parallel else "")


def _stock_spec_summary() -> str:
    if transformer_engine_available():
        return "Transformer Engine spec"
    why = transformer_engine_unavailable()
    spec = "local spec" + ("" if why == "no CUDA device" else f" (no Transformer Engine: {why})")
    fused = fused_softmax_unavailable()
    if fused != "no CUDA device":
        spec += ", fused softmax" if fused is None else f", unfused softmax ({fused})"
    return spec


def padded_vocab_size(cfg: TrainingConfig) -> int:
    """``--vocab-size`` padded up to a multiple of ``--make-vocab-size-divisible-by`` x tp, as Megatron-LM pads it:
    the output layer splits evenly over the tensor-parallel ranks (megatron-core requires it) and its GEMM is
    aligned; the extra rows are never a label."""
    return pad_vocab(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallel.dims.tp)


def pad_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """``vocab_size`` padded up to a multiple of ``divisible_by`` x ``tp`` (:func:`padded_vocab_size`)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def model_shape(cfg: TrainingConfig, name: str = "pretrain_gpt") -> ModelShape:
    """The shape of the GPT- or LLaMA-style model this driver builds, for the planner's cost model and the model
    FLOPs of ``--log-throughput``."""
    return ModelShape(
        name, cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads, cfg.model.ffn_hidden_size, padded_vocab_size(cfg),
        num_kv_heads=cfg.model.kv_heads, kv_channels=cfg.model.kv_channels,
        swiglu=cfg.model.swiglu, normalization=cfg.model.normalization, bias=not cfg.model.disable_bias_linear,
        qkv_bias=cfg.model.add_qkv_bias, qk_norm=cfg.model.qk_layernorm,
        rope=cfg.model.position_embedding_type == "rope",
        dtype=str(params_dtype(cfg)).removeprefix("torch."),  # what the activations and the K/V buffers are stored in
        tied_embeddings=not cfg.model.untie_embeddings_and_output_weights,
        learned_positions=cfg.model.max_position_embeddings if cfg.model.position_embedding_type == "learned_absolute" else 0,
        hidden_dropout=cfg.model.hidden_dropout, attention_dropout=cfg.model.attention_dropout,  # what their masks save
        loss_chunk_tokens=cfg.epp.loss_chunk_tokens,  # what the output head keeps
        mlp_chunk_tokens=cfg.epp.mlp_chunk_tokens,  # what a layer's MLP keeps
    )


def attention_heads(cfg: TrainingConfig) -> tuple[int, int, int]:
    """(query heads, K/V heads, head dim) of one elastic attention call on a rank: the heads split over the
    tensor-parallel ranks, then (context parallelism, Ulysses) over the context-parallel ranks, the K/V heads
    replicated to a multiple of that size first (``executor.attention.replicate_kv_heads``)."""
    m, dims = cfg.model, cfg.parallel.dims
    heads, kv_heads = m.num_attention_heads // dims.tp, (m.kv_heads or m.num_attention_heads) // dims.tp
    if dims.cp > 1:
        heads, kv_heads = heads // dims.cp, math.lcm(kv_heads, dims.cp) // dims.cp
    return heads, kv_heads, m.kv_channels or m.hidden_size // m.num_attention_heads


def decide_attention(cfg: TrainingConfig, device: torch.device, context: ChunkContext) -> str:
    """The elastic attention's kernel for training, decided on this rank into ``context``'s record before the first
    step (as the layers would at their first forward): flash-attn-4 compiles the run's kernel variants in its probe
    here, not in step 1."""
    heads = attention_heads(cfg)
    return kernels.select_backend(kernels.requested_backend(cfg.model.attention_backend), device, params_dtype(cfg),
                                  context.attention_backends, cfg.model.attention_dropout, gqa=heads[1] != heads[0], heads=heads,
                                  deterministic=cfg.model.deterministic_mode)


def architecture_summary(cfg: TrainingConfig) -> str:
    """One phrase for the start-up line: MLP, norm, attention heads, biases, positions."""
    heads = cfg.model.num_attention_heads
    groups = cfg.model.kv_heads or heads
    attention = f"grouped-query attention {heads}:{groups}" if groups != heads else f"{heads}-head attention"
    parts = [
        "SwiGLU MLP" if cfg.model.swiglu else "GELU MLP",
        f"{cfg.model.normalization} (eps {cfg.model.norm_epsilon:g}{', zero-centred weight: 1p' if cfg.model.apply_layernorm_1p else ''})",
        attention + f", head dim {cfg.model.kv_channels or cfg.model.hidden_size // heads}",
        ("QKV biases only" if cfg.model.add_qkv_bias else "no biases") if cfg.model.disable_bias_linear else "biases",
        *(["query and key norms"] if cfg.model.qk_layernorm else []),
        rope_summary(cfg) if cfg.model.position_embedding_type == "rope" else "learned positions",
    ]
    return ", ".join(parts)


def architecture_config(*, swiglu: bool, normalization: str, num_query_groups: int | None, kv_channels: int | None,
                        bias: bool, qkv_bias: bool = False, qk_layernorm: bool = False) -> dict:
    """``TransformerConfig``'s fields for a GPT-, LLaMA- or Qwen-style layer: SwiGLU (gated SiLU) or GELU MLP,
    LayerNorm or RMSNorm, K/V heads (None: one per query head), head dimension (None: hidden / heads),
    biases of the linear layers (or of the QKV layer only: ``qkv_bias``), query and key norms. Shared by the
    training model and ``measure.layer_bench``."""
    return {
        "gated_linear_unit": swiglu, "activation_func": F.silu if swiglu else F.gelu, "normalization": normalization,
        "num_query_groups": num_query_groups, "kv_channels": kv_channels, "add_bias_linear": bias,
        "add_qkv_bias": qkv_bias, "qk_layernorm": qk_layernorm,
    }


def scale_rope(model: GPTModel, cfg: TrainingConfig) -> None:
    """``--use-rope-scaling``: the RoPE frequencies of ``model`` scaled by megatron-core's own llama3 scaling
    (``RotaryEmbedding._apply_scaling``, Hugging Face's ``llama3`` rope) with all four of the run's parameters, where
    ``GPTModel(rope_scaling=True)`` would fix the low/high frequency factors and the original context at 1, 4 and 8192.
    The stock path and the elastic chunks' table (``executor.rotary.RopeTable``: megatron-core's ``get_emb`` of these
    frequencies) both rotate by them."""
    if not cfg.model.use_rope_scaling or cfg.model.position_embedding_type != "rope":
        return
    rotary = model.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq, factor=cfg.model.rope_scaling_factor, low_freq_factor=cfg.model.rope_scaling_low_freq_factor,
        high_freq_factor=cfg.model.rope_scaling_high_freq_factor,
        original_max_position_embeddings=cfg.model.rope_scaling_original_max_position_embeddings)


def rope_summary(cfg: TrainingConfig) -> str:
    """RoPE's base and scaling, for the architecture line."""
    m = cfg.model
    text = f"RoPE base {m.rotary_base}" + (f" on {m.rotary_percent:g} of each head" if m.rotary_percent != 1 else "")
    if m.use_rope_scaling:
        text += (f", llama3 scaling x{m.rope_scaling_factor:g} (low/high frequency factors {m.rope_scaling_low_freq_factor:g}/"
                 f"{m.rope_scaling_high_freq_factor:g}, original context {m.rope_scaling_original_max_position_embeddings})")
    if m.rotary_seq_len_interpolation_factor is not None:
        text += f", linear scaling x{m.rotary_seq_len_interpolation_factor:g}"
    return text


def params_dtype(cfg: TrainingConfig) -> torch.dtype:
    """The parameters' and activations' dtype: ``--bf16``, ``--fp16``, else fp32."""
    return torch.bfloat16 if cfg.model.bf16 else torch.float16 if cfg.model.fp16 else torch.float32


def transformer_config(cfg: TrainingConfig, runtime: Runtime) -> TransformerConfig:
    dtype = params_dtype(cfg)
    return TransformerConfig(
        num_layers=cfg.model.num_layers,
        hidden_size=cfg.model.hidden_size,
        num_attention_heads=cfg.model.num_attention_heads,
        ffn_hidden_size=cfg.model.ffn_hidden_size,
        hidden_dropout=cfg.model.hidden_dropout,
        attention_dropout=cfg.model.attention_dropout,
        init_method_std=cfg.model.init_method_std,
        **architecture_config(
            swiglu=cfg.model.swiglu, normalization=cfg.model.normalization, kv_channels=cfg.model.kv_channels,
            num_query_groups=cfg.model.kv_heads, bias=not cfg.model.disable_bias_linear, qkv_bias=cfg.model.add_qkv_bias,
            qk_layernorm=cfg.model.qk_layernorm,
        ),
        layernorm_epsilon=cfg.model.norm_epsilon,
        layernorm_zero_centered_gamma=cfg.model.apply_layernorm_1p,
        attention_backend=AttnBackend[cfg.model.attention_backend],
        tensor_model_parallel_size=cfg.parallel.dims.tp,
        sequence_parallel=cfg.parallel.dims.sequence_parallel,
        context_parallel_size=cfg.parallel.dims.cp,
        cp_comm_type=CP_COMM_TYPE if cfg.parallel.dims.cp > 1 else None,
        pipeline_model_parallel_size=cfg.parallel.dims.pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=cfg.model.bf16,
        fp16=cfg.model.fp16,
        use_cpu_initialization=runtime.device.type == "cpu",
        recompute_granularity=cfg.model.recompute_granularity,
        recompute_method=cfg.model.recompute_method,
        recompute_num_layers=cfg.model.recompute_num_layers,
        calculate_per_token_loss=True,
        deterministic_mode=cfg.model.deterministic_mode,
        # megatron-core's bias-dropout-add (and bias-activation) fusion is torch.compile without TE/apex
        # (megatron.core.jit.jit_fuser): on CPU 60 s of compilation over 5 chunk shapes and 110 us per call against
        # 19 us unfused (measured 2026-11-25), and elastic chunks bring a new shape each. Its RoPE fusion needs
        # Transformer Engine; the elastic layers build RoPE's tables once per chunk instead (executor.rotary).
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        # only where the kernel imports (apex / megatron fused kernels): it is a CUDA extension
        masked_softmax_fusion=cfg.model.masked_softmax_fusion and runtime.device.type == "cuda" and fused_softmax_unavailable() is None,
        gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=True,
        # Megatron's batch_p2p_sync calls torch.cuda.synchronize() after every batched p2p (a guard
        # for a batch_isend_irecv race fixed in PyTorch long ago): a device sync per chunk and stage.
        batch_p2p_sync=False,
    )


def fused_flags(cfg: TrainingConfig, elastic: bool) -> fused.FusedFlags:
    """What the run's flags and model say of each fused op (the fused RoPE is the elastic chunks' rotation)."""
    m = cfg.model
    return fused.FusedFlags(
        rope_fusion=m.rope_fusion, bias_swiglu_fusion=m.bias_swiglu_fusion, cross_entropy_loss_fusion=m.cross_entropy_loss_fusion,
        rms_norm=m.normalization == "RMSNorm", swiglu=m.swiglu, rope=elastic and m.position_embedding_type == "rope",
        tp=cfg.parallel.dims.tp)


_ANNOUNCED: set[str] = set()


def fused_choice(cfg: TrainingConfig, device: torch.device, elastic: bool, te_layers: bool = False) -> fused.FusedChoice:
    """The run's fused kernels (:func:`megatron_epp.executor.fused.select` of ``EPP_FUSED_KERNELS`` and the flags),
    its start-up line printed once by the first rank; none under Transformer Engine's layers (``te_layers``), which
    are fused already."""
    if te_layers:
        choice = fused.FusedChoice(why=("Transformer Engine's layers: their own fused norm, activation and RoPE",))
    else:
        choice = fused.select(fused.requested(), fused_flags(cfg, elastic), device, params_dtype(cfg))
    _announce(choice.line())
    return choice


def _announce(line: str) -> None:
    """A start-up line, printed once by the first rank."""
    if line not in _ANNOUNCED and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        _ANNOUNCED.add(line)
        print(line, flush=True)


def head_model(cfg: TrainingConfig, choice: fused.FusedChoice) -> tuple[type[GPTModel], dict]:
    """The model class of the run's output head and its keyword arguments: the chunked linear cross entropy
    (``--epp-loss-chunk-tokens``, over a fused cross entropy: its logits are what the blocks avoid), the fused cross
    entropy (``choice``), or megatron-core's ``GPTModel``."""
    if cfg.epp.loss_chunk_tokens:
        _announce(f"> output head: chunked linear cross entropy, blocks of {cfg.epp.loss_chunk_tokens} tokens (--epp-loss-chunk-tokens: "
                  "the logits recomputed in backward, never whole)"
                  + (f"; the fused cross entropy ({choice.cross_entropy}) is not used" if choice.cross_entropy != "torch" else ""))
        return ChunkedLossGPTModel, {"loss_chunk_tokens": cfg.epp.loss_chunk_tokens}
    if choice.cross_entropy != "torch":
        return FusedLossGPTModel, {"cross_entropy_backend": choice.cross_entropy}
    return GPTModel, {}


def build_model(
    cfg: TrainingConfig, runtime: Runtime, context: ChunkContext | None = None
) -> tuple[DistributedDataParallel, TransformerConfig]:
    """This stage's GPTModel on its device, cast to bf16/fp16 by ``Float16Module`` under ``--bf16``/``--fp16``,
    wrapped in Megatron-Core DDP.

    With a ``context`` the layers are elastic (``elastic_layer_spec`` on the local spec) and the
    context is installed on the GPTModel itself, where ``ChunkContext.of`` finds it through the
    DDP and Float16Module wrappers (``get_attr_wrapped_model``); with RoPE, its one table of ``--seq-length``
    positions is built then, on the device, in fp32 (``executor.rotary.RopeTable``).
    """
    config = transformer_config(cfg, runtime)
    m = cfg.model
    te_layers = context is None and transformer_engine_available() and m.attention_backend != "local"
    choice = fused_choice(cfg, runtime.device, elastic=context is not None, te_layers=te_layers)
    spec = (default_layer_spec(m.normalization, local=m.attention_backend == "local", qk_layernorm=m.qk_layernorm) if context is None
            else elastic_layer_spec(elastic_base_layer_spec(m.normalization, m.qk_layernorm), context))
    model_class, head = head_model(cfg, choice)
    if cfg.epp.mlp_chunk_tokens:
        _announce(f"> MLP: in blocks of {cfg.epp.mlp_chunk_tokens} tokens a rank (--epp-mlp-chunk-tokens: each block's MLP "
                  "recomputed in backward, a chunk's MLP activations never whole)")
    model = model_class(
        config,
        decoder_spec(tiled_mlp_spec(fused_layer_spec(spec, choice), cfg.epp.mlp_chunk_tokens), config),
        vocab_size=padded_vocab_size(cfg),
        max_sequence_length=cfg.model.max_position_embeddings,
        pre_process=runtime.is_first_stage,
        post_process=runtime.is_last_stage,
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.model.position_embedding_type,
        rotary_base=cfg.model.rotary_base,
        rotary_percent=cfg.model.rotary_percent,
        seq_len_interpolation_factor=cfg.model.rotary_seq_len_interpolation_factor,
        pg_collection=runtime.pg_collection,  # the layers' groups (the attention's context-parallel all-to-all)
        **head,
    )
    scale_rope(model, cfg)
    model.to(runtime.device)
    if context is not None:  # on its device: RoPE's one table of --seq-length positions is built there, before any step
        install_chunk_context(model, context, cfg.model.seq_length)
        if runtime.device.type == "cuda":  # the kernel decided (and flash-attn-4 compiled) before any step
            decide_attention(cfg, runtime.device, context)
    if cfg.model.bf16 or cfg.model.fp16:
        # As Megatron-LM: every parameter in bf16 (fp16), LayerNorms included (CUDA's layer_norm refuses bf16
        # input with fp32 weights), the first stage's float inputs cast, the last stage's output back
        # to fp32 for the loss. The optimizer keeps fp32 main params (OptimizerConfig bf16).
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not cfg.optim.grad_reduce_in_bf16,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        bucket_size=cfg.parallel.ddp_bucket_size,
    )
    return DistributedDataParallel(config, ddp_config, model, pg_collection=runtime.pg_collection), config  # DP x CP's reduction
