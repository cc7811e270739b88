"""The typed training configuration: ``pretrain_gpt.py``'s flags as one frozen :class:`TrainingConfig` of sections
(model, parallel, optim, training, data, checkpoint, logging, profile, epp).

Each option is declared once, as a field: its Megatron-LM flag, default, help and argparse details are the field's
metadata (:func:`~megatron_epp.base.options.option`), and ``arguments.py`` generates the parser from the fields. A
field is named after its flag (``--lr-decay-style`` is ``optim.lr_decay_style``), less the ``epp_`` prefix in the
``epp`` section (``--epp-timeline`` is ``epp.timeline``) and ``profile_`` in the ``profile`` section
(``--profile-step-start`` is ``profile.step_start``). A field no flag sets is derived
(:func:`~megatron_epp.base.options.derived`): validation computes it from the options, e.g. ``parallel.dims`` (one
:class:`~megatron_epp.base.dims.ParallelDims`), ``optim.lr_warmup_samples`` from ``--lr-warmup-iters`` and
``epp.planner`` (the planner's :class:`~megatron_epp.planner.config.PlannerConfig`, the memory budget in bytes).

What else reads a field is its metadata too: a numeric option's range (``option(..., at_least=1)``, checked by
validation) and its tags (:mod:`~megatron_epp.base.option_tags`: the checkpoint's model shape and sampler record, what
``--finetune`` may change, which ``--epp-*`` options need ``--elastic-pp`` and which the layout search refuses).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from megatron_epp.base.option_tags import (ELASTIC_ONLY, FINETUNE_FREE, MODEL_SHAPE, REFUSED_BY_SEARCH, ROPE_SCALING, SAMPLER,
                                           SEARCH_DOES_NOT_TRAIN, SEARCH_MODELS_THE_PRESET, VOCAB_PADDING)
from megatron_epp.base.options import Values, alias, derived, field_paths, option, read_fields, replace_keys
from megatron_epp.data.data_path import Blend
from megatron_epp.data.tokenizers import TokenizerOptions
from megatron_epp.base.dims import ParallelDims
from megatron_epp.planner.config import CALIBRATE_FIRST_STEP, PlannerConfig, PlannerOptions, ShapeOptions
from megatron_epp.config.megatron_flags import ACCEPTED
from megatron_epp.config.memory_budget import DefaultBudget

ROTARY_BASE = 10000  # Megatron-LM's default RoPE base
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")  # Megatron-LM's --attention-backend
PROFILE_STEPS = (10, 12)  # Megatron-LM's --profile-step-start and --profile-step-end
CALIBRATE_INTERVAL = 20  # --epp-calibrate-interval's default (the first fit: after step CALIBRATE_FIRST_STEP)


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, architecture, precision and megatron-core's own activation recompute."""

    GROUP: ClassVar[str] = "model"
    num_layers: int = option("--num-layers", at_least=1, tags={MODEL_SHAPE: 0}, default=4, type=int,
        help="transformer layers (default 4, a toy; Megatron-LM: required)")
    hidden_size: int = option("--hidden-size", at_least=1, tags={MODEL_SHAPE: 1}, default=64, type=int,
        help="hidden size (default 64, a toy; Megatron-LM: required)")
    num_attention_heads: int = option("--num-attention-heads", at_least=1, tags={MODEL_SHAPE: 2}, default=4, type=int,
        help="query heads (default 4, a toy; Megatron-LM: required)")
    ffn_hidden_size: int = option("--ffn-hidden-size", at_least=1, tags={MODEL_SHAPE: 3}, type=int,
        help="default: 4 x hidden size; with --swiglu 8/3 x hidden size rounded down to a multiple of 64 (Megatron-LM's)")
    seq_length: int = option("--seq-length", at_least=1, tags={SAMPLER: 2}, default=128, type=int,
        help="tokens per sample (default 128; Megatron-LM: required); with --elastic-pp the context cap: the "
             "longest document trained (see --epp-truncate-documents), not a fixed sample length")
    max_position_embeddings: int = option("--max-position-embeddings", at_least=1, tags={MODEL_SHAPE: 4, FINETUNE_FREE: True}, type=int,
        help="default: --seq-length")
    position_embedding_type: str = option("--position-embedding-type", tags={MODEL_SHAPE: 5}, default="rope", choices=["rope", "learned_absolute"],
        help="default rope (Megatron-LM: learned_absolute)")
    use_rotary_position_embeddings: bool = option("--use-rotary-position-embeddings", default=False, action="store_true",
        help="Megatron-LM's older spelling of --position-embedding-type rope")
    add_position_embedding: bool = option("--no-position-embedding", default=True, action="store_false", dest="add_position_embedding",
        help="no learned absolute position embedding, as Megatron-LM: with rope (the default here) there is "
             "none anyway; with learned_absolute it is refused (position-free models are not supported, as in Megatron-LM)")
    rotary_percent: float = option("--rotary-percent", tags={MODEL_SHAPE: 18}, default=1.0, type=float,
        help="the share of each head's channels RoPE rotates (default 1.0, as Megatron-LM)")
    vocab_size: int = option("--vocab-size", at_least=1, tags={MODEL_SHAPE: 6}, type=int,
        help="default: the tokenizer's (byte: 257)")
    make_vocab_size_divisible_by: int = option("--make-vocab-size-divisible-by", tags={MODEL_SHAPE: 15, VOCAB_PADDING: True}, default=128, type=int,
        help="pad the vocabulary (embedding and output layer rows) up to a multiple of this x "
             "--tensor-model-parallel-size, as Megatron-LM (the padded rows are never a label)")
    untie_embeddings_and_output_weights: bool = option("--untie-embeddings-and-output-weights", tags={MODEL_SHAPE: 7}, default=False, action="store_true",
        help="separate input embedding and output layer weights (default: shared, as Megatron-LM)")
    hidden_dropout: float = option("--hidden-dropout", at_least=0, at_most=1, default=0.0, type=float,
        help="dropout after attention and MLP (default 0.0; Megatron-LM: 0.1)")
    attention_dropout: float = option("--attention-dropout", at_least=0, at_most=1, default=0.0, type=float,
        help="dropout of the attention probabilities (default 0.0; Megatron-LM: 0.1)")
    init_method_std: float = option("--init-method-std", at_least=0, default=0.02, type=float,
        help="weights' initial standard deviation (default 0.02)")
    swiglu: bool = option("--swiglu", tags={MODEL_SHAPE: 8}, default=False, action="store_true",
        help="SwiGLU MLP (gated SiLU: fc1 is 2 x --ffn-hidden-size wide)")
    normalization: str = option("--normalization", tags={MODEL_SHAPE: 9}, default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
        help="the layers' norm (default LayerNorm)")
    norm_epsilon: float = option("--norm-epsilon", tags={MODEL_SHAPE: 16}, default=1e-5, type=float,
        help="the norms' epsilon (default 1e-5)")
    apply_layernorm_1p: bool = option("--apply-layernorm-1p", tags={MODEL_SHAPE: 17}, default=False, action="store_true",
        help="zero-centred norm weights, as Megatron-LM: the norm multiplies by (1 + weight), the weight "
             "initialised to 0 (megatron-core's layernorm_zero_centered_gamma)")
    group_query_attention: bool = option("--group-query-attention", tags={MODEL_SHAPE: 10}, default=False, action="store_true",
        help="grouped-query attention (needs --num-query-groups)")
    num_query_groups: int | None = option("--num-query-groups", tags={MODEL_SHAPE: 11}, type=int,
        help="K/V heads with --group-query-attention")
    kv_channels: int | None = option("--kv-channels", tags={MODEL_SHAPE: 12}, type=int,
        help="head dimension (default: --hidden-size / --num-attention-heads)")
    disable_bias_linear: bool = option("--disable-bias-linear", tags={MODEL_SHAPE: 13}, default=False, action="store_true",
        help="no biases in the linear layers")
    add_qkv_bias: bool = option("--add-qkv-bias", tags={MODEL_SHAPE: 25}, default=False, action="store_true",
        help="biases in the QKV linear layer only, with --disable-bias-linear (Qwen2's attention; megatron-core's add_qkv_bias)")
    qk_layernorm: bool = option("--qk-layernorm", tags={MODEL_SHAPE: 26}, default=False, action="store_true",
        help="a norm (--normalization) over each head's query and key before RoPE, one weight of the head dimension "
             "shared by the heads (Qwen3's q_norm and k_norm; megatron-core's qk_layernorm)")
    rotary_base: int = option("--rotary-base", tags={MODEL_SHAPE: 14, FINETUNE_FREE: True}, type=int,
        help=f"RoPE's base (theta; default {ROTARY_BASE})")
    use_rope_scaling: bool = option("--use-rope-scaling", tags={MODEL_SHAPE: 19, FINETUNE_FREE: True, ROPE_SCALING: True}, default=False, action="store_true",
        help="LLaMA 3.x RoPE scaling (Hugging Face's rope_type llama3; megatron-core's rope_scaling): low "
             "frequencies divided by --rope-scaling-factor, high ones kept, the band between interpolated")
    rope_scaling_factor: float = option("--rope-scaling-factor", tags={MODEL_SHAPE: 20, FINETUNE_FREE: True, ROPE_SCALING: True}, type=float,
        help="with --use-rope-scaling (default 8.0, as Megatron-LM)")
    rope_scaling_low_freq_factor: float = option("--rope-scaling-low-freq-factor", tags={MODEL_SHAPE: 21, FINETUNE_FREE: True, ROPE_SCALING: True}, type=float,
        help="with --use-rope-scaling: llama3's low_freq_factor (default 1.0, megatron-core's fixed value)")
    rope_scaling_high_freq_factor: float = option("--rope-scaling-high-freq-factor", tags={MODEL_SHAPE: 22, FINETUNE_FREE: True, ROPE_SCALING: True}, type=float,
        help="with --use-rope-scaling: llama3's high_freq_factor (default 4.0, megatron-core's fixed value)")
    rope_scaling_original_max_position_embeddings: int = option("--rope-scaling-original-max-position-embeddings", tags={MODEL_SHAPE: 23, FINETUNE_FREE: True, ROPE_SCALING: True}, type=int,
        help="with --use-rope-scaling: llama3's original_max_position_embeddings, the context the model was "
             "pretrained at (default 8192, megatron-core's fixed value)")
    rotary_seq_len_interpolation_factor: float | None = option("--rotary-seq-len-interpolation-factor", tags={MODEL_SHAPE: 24, FINETUNE_FREE: True, ROPE_SCALING: True}, type=float,
        help="linear RoPE scaling (Hugging Face's rope_type linear): positions divided by this factor (megatron-core's "
             "seq_len_interpolation_factor)")
    attention_backend: str = option("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
        help="with --elastic-pp, ElasticAttention's kernels: auto = flash-attn where it runs, else PyTorch's "
             "SDPA; flash = flash-attn (an error where it cannot run); local, unfused = SDPA; fused = auto "
             "(Transformer Engine's cuDNN attention is not used; said at start-up). Without --elastic-pp "
             "megatron-core's: local = its own attention, flash/fused/unfused = Transformer Engine's (refused without "
             "it), auto = Transformer Engine's choice where it is used (default auto)",
        aliases=(alias("--use-flash-attn", action="store_const", const="flash", help="Megatron-LM's older spelling of --attention-backend flash"),))
    rope_fusion: bool = option("--no-rope-fusion", default=True, action="store_false", dest="rope_fusion",
        help="never a fused RoPE kernel (as Megatron-LM); by default, on CUDA, the elastic chunks' rotation runs a fused "
             "kernel where one runs (EPP_FUSED_KERNELS, docs/gpu.md); on the CPU never (today's rotation)")
    bias_swiglu_fusion: bool = option("--no-bias-swiglu-fusion", default=True, action="store_false", dest="bias_swiglu_fusion",
        help="never a fused SwiGLU kernel (as Megatron-LM); by default, on CUDA, the MLP's gated SiLU runs a fused kernel "
             "where one runs (EPP_FUSED_KERNELS, docs/gpu.md); on the CPU never")
    cross_entropy_loss_fusion: bool = option("--cross-entropy-loss-fusion", default=False, action="store_true",
        help="a fused cross entropy of the output head on CUDA (as Megatron-LM: off by default): a library's kernel at TP 1, "
             "megatron-core's fused vocab-parallel one at TP > 1 (EPP_FUSED_KERNELS, docs/gpu.md); on the CPU "
             "megatron-core's unfused one unless EPP_FUSED_KERNELS names a backend")
    deterministic_mode: bool = option("--deterministic-mode", default=False, action="store_true",
        help="as Megatron-LM: megatron-core's deterministic paths (its config's deterministic_mode), and the elastic "
             "attention's deterministic backward where the kernel has one (flash-attn-4, flash-attn: no atomic "
             "accumulation of dQ, slower); the CPU's kernels are deterministic already")
    masked_softmax_fusion: bool = option("--no-masked-softmax-fusion", default=True, action="store_false", dest="masked_softmax_fusion",
        help="without --elastic-pp, never megatron's fused masked softmax (by default it is used on CUDA where "
             "it imports); ElasticAttention has none")
    bf16: bool = option("--bf16", default=False, action="store_true",
        help="bf16 parameters and activations (megatron-core's Float16Module), fp32 main parameters in the optimizer", group="optimisation")
    fp16: bool = option("--fp16", default=False, action="store_true",
        help="fp16 parameters and activations with loss scaling (dynamic unless --loss-scale), fp32 main "
             "parameters; a step whose scaled gradients overflow is skipped and the scale lowered, as Megatron-LM", group="optimisation")
    recompute_granularity: str | None = option("--recompute-granularity", choices=["full", "selective"],
        help="without --elastic-pp: megatron-core's activation recompute (with it, the plan decides: --epp-recompute)", group="activation recompute")
    recompute_method: str | None = option("--recompute-method", choices=["uniform", "block"],
        help="--recompute-granularity full: which layers are recomputed", group="activation recompute")
    recompute_num_layers: int | None = option("--recompute-num-layers", type=int,
        help="--recompute-granularity full: layers per recomputed group (default 1)", group="activation recompute")

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def kv_heads(self) -> int | None:
        """K/V heads with grouped-query attention, else None (as many as query heads)."""
        return self.num_query_groups if self.group_query_attention else None


@dataclass(frozen=True)
class ParallelConfig:
    """The layout (``dims``: tp, pp, dp, cp, sequence parallelism, world size; derived from the sizes given and the
    world size) and the data-parallel machinery."""

    GROUP: ClassVar[str] = "parallelism"
    tensor_model_parallel_size: int = option("--tensor-model-parallel-size", default=1, type=int,
        help="tensor-parallel ranks (default 1)")
    pipeline_model_parallel_size: int = option("--pipeline-model-parallel-size", default=1, type=int,
        help="pipeline stages (default 1)")
    virtual_pipeline_model_parallel_size: int | None = option("--virtual-pipeline-model-parallel-size", type=int,
        help="Megatron's interleaved schedule: not supported (the elastic schedule runs one model chunk per stage)")
    context_parallel_size: int | None = option("--context-parallel-size", type=int,
        help="context-parallel ranks per pipeline stage (with --elastic-pp; default 1): Ulysses, each chunk's tokens "
             "split evenly over them (padded to a multiple), an all-to-all to heads / N around core attention")
    cp_comm_type: list[str] | str | None = option("--cp-comm-type", nargs="+",
        help="context parallelism's communication: a2a (Ulysses, the only one implemented; also what "
             "--context-parallel-size alone means here); p2p, allgather, a2a+p2p are refused")
    sequence_parallel: bool = option("--sequence-parallel", default=False, action="store_true",
        help="Megatron's sequence parallelism: activations outside attention split along the sequence over "
             "the tensor-parallel ranks (needs --tensor-model-parallel-size > 1; with --elastic-pp each chunk is padded to a "
             "multiple of it)")
    use_distributed_optimizer: bool = option("--use-distributed-optimizer", default=False, action="store_true",
        help="shard the optimizer states (and fp32 main params) over the data-parallel ranks (ZeRO-1)")
    overlap_grad_reduce: bool = option("--overlap-grad-reduce", default=False, action="store_true",
        help="reduce gradients bucket by bucket while the backward runs (DDP buckets)")
    ddp_bucket_size: int | None = option("--ddp-bucket-size", type=int,
        help="parameters per DDP gradient bucket with --overlap-grad-reduce "
             "(default: megatron-core's, max(4e7, 1e6 x data parallel))")
    distributed_timeout_minutes: float = option("--distributed-timeout-minutes", default=10.0, type=float, metavar="M",
        help="a collective that waits longer (a dead or hung rank) fails the job (default 10)", group="preemption and faults")
    dims: ParallelDims | None = derived()
    sequence_parallel_off_at_tp1: bool = derived(False)  # --sequence-parallel given at tp 1: turned off, a start-up line says so


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer, the learning-rate schedule (in samples, as megatron-core's scheduler counts: validation turns
    ``--lr-*-iters`` and ``--lr-warmup-fraction`` into ``lr_warmup_samples``, ``lr_decay_samples`` and
    ``lr_wsd_decay_samples_total``) and fp16's loss scaling."""

    GROUP: ClassVar[str] = "optimisation"
    lr: float = option("--lr", at_least=0, default=1e-3, type=float,
        help="peak learning rate (default 1e-3; Megatron-LM: none)")
    min_lr: float = option("--min-lr", at_least=0, default=0.0, type=float,
        help="the learning rate the decay ends at (default 0.0)")
    lr_decay_style: str = option("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        help="learning-rate decay after the warm-up, megatron-core's OptimizerParamScheduler (default cosine; "
             "Megatron-LM: linear); WSD: --lr until the last --lr-wsd-decay-iters/-samples of the decay, then "
             "--lr-wsd-decay-style down to --min-lr")
    lr_wsd_decay_style: str = option("--lr-wsd-decay-style", default="exponential", choices=["exponential", "linear", "cosine", "minus_sqrt"],
        help="the annealing of --lr-decay-style WSD (default exponential, as Megatron-LM)")
    lr_wsd_decay_iters: int | None = option("--lr-wsd-decay-iters", above=0, type=int,
        help="--lr-decay-style WSD: iterations of annealing")
    lr_wsd_decay_samples: int | None = option("--lr-wsd-decay-samples", above=0, type=int,
        help="--lr-decay-style WSD with --train-samples: samples of annealing")
    lr_warmup_iters: int = option("--lr-warmup-iters", at_least=0, default=0, type=int,
        help="warm-up iterations (default 0)")
    lr_warmup_fraction: float | None = option("--lr-warmup-fraction", at_least=0, below=1, type=float,
        help="warm-up as a fraction of the decay (--lr-decay-iters or --lr-decay-samples), as Megatron-LM; "
             "instead of --lr-warmup-iters/-samples")
    lr_warmup_init: float = option("--lr-warmup-init", default=0.0, type=float,
        help="the learning rate the warm-up (--lr-warmup-iters or --lr-warmup-samples) starts from (default 0.0)")
    lr_decay_iters: int | None = option("--lr-decay-iters", at_least=1, type=int,
        help="default: --train-iters")
    lr_warmup_samples: float = option("--lr-warmup-samples", at_least=0, default=0, type=int,
        help="with --train-samples: warm-up in samples")
    lr_decay_samples: int = option("--lr-decay-samples", at_least=1, type=int,
        help="with --train-samples: decay in samples (default: --train-samples)")
    decoupled_lr: float | None = option("--decoupled-lr", at_least=0, type=float,
        help="a separate peak learning rate for the input embedding and the output layer, as Megatron-LM")
    decoupled_min_lr: float | None = option("--decoupled-min-lr", at_least=0, type=float,
        help="their --min-lr, with --decoupled-lr")
    optimizer: str = option("--optimizer", default="adam", choices=["adam", "sgd"],
        help="megatron-core's optimizer (default adam)")
    sgd_momentum: float = option("--sgd-momentum", at_least=0, default=0.9, type=float,
        help="--optimizer sgd's momentum (default 0.9)")
    weight_decay: float = option("--weight-decay", at_least=0, default=0.01, type=float,
        help="weight decay of the weights (not biases and norms; default 0.01)")
    adam_beta1: float = option("--adam-beta1", at_least=0, below=1, default=0.9, type=float,
        help="Adam's beta1 (default 0.9)")
    adam_beta2: float = option("--adam-beta2", at_least=0, below=1, default=0.95, type=float,
        help="Adam's beta2 (default 0.95; Megatron-LM: 0.999)")
    adam_eps: float = option("--adam-eps", at_least=0, default=1e-8, type=float,
        help="Adam's epsilon (default 1e-8)")
    clip_grad: float = option("--clip-grad", at_least=0, default=1.0, type=float,
        help="gradient clipping by global norm (default 1.0; 0: off)")
    grad_reduce_in_bf16: bool = option("--grad-reduce-in-bf16", default=False, action="store_true",
        help="with --bf16, gradients accumulated and reduced in bf16 (default: in fp32)")
    loss_scale: float | None = option("--loss-scale", above=0, type=float,
        help="--fp16: a fixed loss scale (default: dynamic)")
    initial_loss_scale: float = option("--initial-loss-scale", above=0, default=2.0**32, type=float,
        help="--fp16: the dynamic scale's start (default 2^32)")
    min_loss_scale: float = option("--min-loss-scale", above=0, default=1.0, type=float,
        help="--fp16: the dynamic scale's floor (default 1.0)")
    loss_scale_window: float = option("--loss-scale-window", above=0, default=1000, type=float,
        help="--fp16: steps without overflow before the dynamic scale doubles (default 1000)")
    hysteresis: int = option("--hysteresis", above=0, default=2, type=int,
        help="--fp16: overflowing steps tolerated before the dynamic scale halves (default 2)")
    lr_wsd_decay_samples_total: int | None = derived()


@dataclass(frozen=True)
class TrainingSection:
    """The run: its length, batch, seed, garbage collection, checks and exit conditions."""

    GROUP: ClassVar[str] = "optimisation"
    micro_batch_size: int = option("--micro-batch-size", at_least=1, default=1, type=int,
        help="samples per micro-batch (default 1; Megatron-LM: required); with --elastic-pp each step's "
             "documents are planned into chunks, which replace micro-batches: the value is not used (said at start-up)", group="batch")
    global_batch_size: int = option("--global-batch-size", at_least=1, tags={SAMPLER: 3}, type=int,
        help="default: micro batch x data parallel", group="batch")
    train_iters: int = option("--train-iters", type=int,
        help="default 20 (unless --train-samples)")
    train_samples: int | None = option("--train-samples", at_least=1, type=int,
        help="train this many samples (--elastic-pp: documents) instead of --train-iters: "
             "floor(N / --global-batch-size) iterations, as Megatron-LM")
    seed: int = option("--seed", tags={SAMPLER: 1}, default=1234, type=int,
        help="random seed of initialisation, data order and dropout (default 1234)")
    manual_gc: bool = option("--manual-gc", default=False, action="store_true",
        help="Python's garbage collector off during training, collected every --manual-gc-interval steps "
             "(and around evaluations), as Megatron-LM: the same collection on every rank")
    manual_gc_interval: int = option("--manual-gc-interval", at_least=0, default=0, type=int,
        help="--manual-gc: collect every N iterations (default 0: only at start and around evaluations)")
    manual_gc_eval: bool = option("--no-manual-gc-eval", default=True, action="store_false", dest="manual_gc_eval",
        help="--manual-gc: no collection around evaluations")
    empty_unused_memory_level: int = option("--empty-unused-memory-level", default=0, type=int, choices=[0, 1, 2],
        help="on CUDA, release the allocator's cached blocks: 1 after each forward-backward, 2 also after the "
             "optimizer step (default 0; no effect on CPU)")
    exit_signal_handler: bool = option("--exit-signal-handler", default=False, action="store_true",
        help="on SIGTERM (preemption, scancel, a SLURM --signal), every rank finishes the current step, "
             "saves a checkpoint and exits 0 (needs --save)", group="preemption and faults")
    exit_interval: int | None = option("--exit-interval", type=int, metavar="N",
        help="exit after an iteration divisible by N, saving when --save is given", group="preemption and faults")
    exit_duration_in_mins: float | None = option("--exit-duration-in-mins", type=float, metavar="M",
        help="exit after the step during which M minutes since start passed, saving when --save is given", group="preemption and faults")
    check_for_nan_in_loss_and_grad: bool = option("--check-for-nan-in-loss-and-grad", default=True, action=argparse.BooleanOptionalAction,
        help="a NaN/Inf loss or gradient stops the run before the update, naming the iteration and the rank "
             "(default: on, as Megatron-LM; --no-check-for-nan-in-loss-and-grad turns it off)", group="preemption and faults")
    num_microbatches: int | None = derived()


@dataclass(frozen=True)
class DataConfig(TokenizerOptions):
    """The corpus (mock, or a blend of indexed datasets), its split and the tokenizer (its flags: ``TokenizerOptions``)."""

    GROUP: ClassVar[str] = "data"
    mock_data: bool = option("--mock-data", default=False, action="store_true",
        help="synthetic learnable sequences")
    data_path: list[str] | None = option("--data-path", nargs="+", metavar="[WEIGHT] PREFIX",
        help="prefix of a Megatron indexed dataset (.bin/.idx), or a blend: WEIGHT PREFIX pairs (0.3 A 0.7 B)")
    split: str = option("--split", tags={SAMPLER: 0}, default="969,30,1",
        help="train,valid,test weights over documents (default 969,30,1)")
    eod_mask_loss: bool = option("--eod-mask-loss", default=False, action="store_true",
        help="no loss on the token after an end-of-document token, as Megatron-LM; with --elastic-pp a document "
             "never predicts past its end anyway")
    sft: bool = option("--sft", default=False, action="store_true",
        help="supervised fine-tuning on conversations, as Megatron-LM's: the --data-path datasets are conversations "
             "prepared with epp-prepare-data --sft and the loss is on the assistant's tokens only (their loss masks, "
             "PREFIX_loss_mask.bin/.idx), per token over the global batch; needs --elastic-pp")
    data_blend: Blend | None = derived()
    eod: int | None = derived()  # the tokenizer's end-of-document id


@dataclass(frozen=True)
class CheckpointConfig:
    GROUP: ClassVar[str] = "checkpointing"
    save: str | None = option("--save", 
        help="directory to save checkpoints to (iter_XXXXXXX/, as Megatron-LM)")
    load: str | None = option("--load", 
        help="directory to resume from: its latest checkpoint whose files match the checksums recorded at save "
             "(else the newest older one that does, saying so: see --no-ckpt-fallback); a directory with no "
             "checkpoint yet, or none at all, starts from scratch with a warning (--save X --load X), as Megatron-LM")
    save_interval: int | None = option("--save-interval", at_least=1, type=int,
        help="save every N iterations (and at the end)")
    ckpt_fallback: bool = option("--no-ckpt-fallback", default=True, dest="ckpt_fallback", action="store_false",
        help="a damaged latest checkpoint (a file missing, of another size or failing its checksum) is an "
             "error instead of falling back to the newest older checkpoint that verifies")
    exit_on_missing_checkpoint: bool = option("--exit-on-missing-checkpoint", default=False, action="store_true",
        help="with --load: exit with an error if the directory holds no checkpoint, instead of starting from scratch")
    no_load_optim: bool = option("--no-load-optim", default=False, action="store_true",
        help="do not load the optimizer states (nor, as Megatron-LM, the LR schedule's position) from the checkpoint")
    no_load_rng: bool = option("--no-load-rng", default=False, action="store_true",
        help="do not load the random number generators' states from the checkpoint")
    finetune: bool = option("--finetune", default=False, action="store_true",
        help="load the model weights only: no optimizer, LR schedule or RNG state, and start at iteration 0, "
             "sample 0 (as Megatron-LM)")
    dist_ckpt_optim_fully_reshardable: bool = option("--dist-ckpt-optim-fully-reshardable", default=False, action="store_true",
        help="with --use-distributed-optimizer: save its states in megatron-core's fully_reshardable format "
             "(gathered over the data-parallel ranks at save, in model space), which loads at any other tensor and "
             "pipeline size too; the default dp_reshardable format (each rank its own shard, no gather) reshards "
             "over the data-parallel size only (as Megatron-LM)")
    ckpt_format: str = option("--ckpt-format", default="torch_dist",
        help="torch_dist only: megatron-core's distributed checkpoint, what megatron-epp writes and reads "
             "(Megatron-LM's default)")


@dataclass(frozen=True)
class LoggingConfig:
    GROUP: ClassVar[str] = "logging"
    log_interval: int = option("--log-interval", default=1, type=int,
        help="iterations per log line (default 1; Megatron-LM: 100)")
    eval_interval: int | None = option("--eval-interval", at_least=1, type=int,
        help="evaluate every N iterations (default: never; Megatron-LM: 1000)")
    eval_iters: int = option("--eval-iters", at_least=0, default=2, type=int,
        help="global batches per evaluation (default 2; Megatron-LM: 100); 0 turns evaluation off")
    tensorboard_dir: str | None = option("--tensorboard-dir",
        help="TensorBoard scalars: loss, lr, grad norm, tokens/s, "
             "throughput, and with --elastic-pp the plan's statistics and per-stage memory")
    log_throughput: bool = option("--log-throughput", default=False, action="store_true",
        help="model TFLOP/s per GPU in the log line (the tokens trained, causal attention per document)")
    wandb_project: str | None = option("--wandb-project", 
        help="log the same scalars to this wandb project (needs wandb)")
    wandb_exp_name: str | None = option("--wandb-exp-name", 
        help="the wandb run's name (default: wandb's)")
    wandb_save_dir: str | None = option("--wandb-save-dir", 
        help="wandb's local directory (default: SAVE/wandb with --save)")
    epp_metrics: str | None = option("--epp-metrics", metavar="FILE",
        help="append one JSON record per logged step to FILE (default: metrics.jsonl in --tensorboard-dir, "
             "else in --save; none without either)")


@dataclass(frozen=True)
class ProfileConfig:
    """``--profile`` (``enabled``): the iterations ``[step_start, step_end)`` (as the log counts them) of the
    ``ranks`` that profile, under nsys or, with ``--use-pytorch-profiler``, torch.profiler."""

    GROUP: ClassVar[str] = "profiling"
    enabled: bool = option("--profile", default=False, action="store_true",
        help="profile iterations [--profile-step-start, --profile-step-end) on --profile-ranks, as Megatron-LM: "
             "cudaProfilerStart before the first and cudaProfilerStop after the last, NVTX ranges (emit_nvtx, "
             "record_shapes) in between, for `nsys profile --capture-range=cudaProfilerApi "
             "--capture-range-end=stop` (on CPU nothing to capture: said at start-up); with "
             "--use-pytorch-profiler a torch.profiler trace instead. With --elastic-pp each chunk's forward and "
             "backward is a named range: 'epp F p0 c3 split 4096t stage 1' (pipeline, chunk, kind, tokens, stage)")
    step_start: int | None = option("--profile-step-start", type=int, metavar="N",
        help=f"the first profiled iteration, numbered as in the log (default {PROFILE_STEPS[0]}, as Megatron-LM)")
    step_end: int | None = option("--profile-step-end", type=int, metavar="N",
        help=f"the iteration after the last profiled one (default {PROFILE_STEPS[1]}, as Megatron-LM)")
    ranks: tuple[int, ...] | None = option("--profile-ranks", type=int, nargs="+", metavar="RANK",
        help="the global ranks that profile (default 0, as Megatron-LM)")
    use_pytorch_profiler: bool = option("--use-pytorch-profiler", default=False, action="store_true",
        help="with --profile: torch.profiler on --profile-ranks (CPU activities, and CUDA's on a GPU; "
             "record_shapes, with_stack), one trace per rank written under --tensorboard-dir by "
             "torch.profiler.tensorboard_trace_handler (HOST_PID.TIME.pt.trace.json, named in a log line), as "
             "Megatron-LM; needs --tensorboard-dir")


@dataclass(frozen=True)
class EPPConfig(PlannerOptions, ShapeOptions):
    """``--elastic-pp`` (``enabled``) and the ``--epp-*`` options (the planner's: ``PlannerOptions``; the chunked head's
    and the tiled MLP's: ``ShapeOptions``, which the model is built with and the planner counts); ``planner``: the
    planner's settings made of them (with ``--elastic-pp`` or ``--epp-search-layout``, else None), its budget in bytes;
    ``default_budget``: how the budget was derived when ``--epp-memory-budget`` was not given (None where it was)."""

    GROUP: ClassVar[str] = "elastic pipeline parallelism"
    enabled: bool = option("--elastic-pp", default=False, action="store_true",
        help="whole documents per global batch, planned every step into batched/split/hybrid chunks")
    profile_cache: str | None = option("--epp-profile-cache", tags={ELASTIC_ONLY: True, REFUSED_BY_SEARCH: SEARCH_MODELS_THE_PRESET}, metavar="DIR",
        help="where --epp-profile auto keeps the profiles it measures on a GPU, one per GPU name, dtype, "
             "attention kernel and layer shape (default $XDG_CACHE_HOME/megatron-epp/profiles, ~/.cache without it)")
    truncate_documents: bool = option("--epp-truncate-documents", tags=(ELASTIC_ONLY,), default=False, action="store_true",
        help="train documents longer than --seq-length (the context cap) on their first --seq-length "
             "tokens; without it such a document is an error before training")
    timeline: str | None = option("--epp-timeline", tags={ELASTIC_ONLY: True, REFUSED_BY_SEARCH: SEARCH_DOES_NOT_TRAIN},
        help="directory: the planned timeline picture of every logged step")
    plan_between_steps: bool = option("--epp-plan-between-steps", default=False, action="store_true",
        tags={ELASTIC_ONLY: True, REFUSED_BY_SEARCH: SEARCH_DOES_NOT_TRAIN},
        help="plan each global batch after the previous step's schedule, on the planning rank's own thread, instead "
             "of in a background thread while the previous step runs: the planner then shares no core with a "
             "training rank inside a step (for timing on hosts whose ranks take every core), and its time is exposed "
             "(the log's 'planning ms ... exposed'); the plan is made on the cost model as calibrated up to the "
             "previous step")
    calibrate_interval: int | None = option("--epp-calibrate-interval", tags={ELASTIC_ONLY: True, REFUSED_BY_SEARCH: SEARCH_DOES_NOT_TRAIN}, type=int, metavar="N",
        help="refit the planner's cost model to this machine (speed factor s and per-chunk stage overhead o) "
             f"on the measured steps: after step {CALIBRATE_FIRST_STEP} (the first step of a run or a resumed run is "
             f"warm-up and left out), then every N steps, on the last max(N, {CALIBRATE_FIRST_STEP - 1}) steps; and its "
             "activation memory factor (the largest measured / predicted activation peak, at least 1) at the same "
             "steps and at once after a step over --epp-memory-budget; saved "
             f"in checkpoints; 0: off, the profile as given (default {CALIBRATE_INTERVAL})")
    planner: PlannerConfig | None = derived()
    default_budget: DefaultBudget | None = derived()


@dataclass(frozen=True)
class TrainingConfig:
    """Everything a training run reads: ``TrainingConfig()`` is every option's default; :func:`from_namespace` the
    options a command line gave; validation (``arguments.validate``) makes the final one."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    training: TrainingSection = field(default_factory=TrainingSection)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    epp: EPPConfig = field(default_factory=EPPConfig)
    accepted_flags: tuple[str, ...] = derived(())  # Megatron-LM flags given that have no effect here (the start-up line)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> "TrainingConfig":
        """The options as parsed (before validation): every parsed name goes into its field, or is an accepted
        Megatron-LM flag; a name with neither (an ``add_argument`` beside the fields) is a ``TypeError``."""
        values = dict(vars(args))
        accepted = tuple(entry.flag for entry in ACCEPTED if values.pop(entry.dest) not in (None, False))
        cfg = read_fields(cls, values)
        if values:
            raise TypeError(f"parsed options without a field: {', '.join(sorted(values))}")
        return dataclasses.replace(cfg, accepted_flags=accepted)

    def values(self) -> Values:
        """A read-only view of every field by its flag's dest (``cfg.values().lr_warmup_iters``): what validation reads."""
        return Values(self, PATHS)

    def with_values(self, changes: dict[str, Any]) -> "TrainingConfig":
        """A copy with fields changed by their dests (what each validation step returns)."""
        return replace_keys(self, PATHS, changes)

    def replace(self, **changes: dict[str, Any]) -> "TrainingConfig":
        """A copy with some sections' fields changed: ``cfg.replace(model={"vocab_size": 64})``."""
        return dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), **values)
                                            for name, values in changes.items()})

    def flat(self) -> dict[str, Any]:
        """Every setting as ``section.field``: plain values (what wandb's run config records)."""
        out: dict[str, Any] = {}
        for section in fields(self):
            value = getattr(self, section.name)
            if not dataclasses.is_dataclass(value):
                out[section.name] = list(value) if isinstance(value, tuple) else value
                continue
            for f in fields(value):
                item = getattr(value, f.name)
                inner = {g.name: getattr(item, g.name) for g in fields(item)} if dataclasses.is_dataclass(item) else {"": item}
                for key, v in inner.items():
                    plain = v if isinstance(v, (bool, int, float, str, list, type(None))) else str(v)
                    out[f"{section.name}.{f.name}" + (f".{key}" if key else "")] = plain
        return out


PATHS = field_paths(TrainingConfig)  # every field's dest (its flag's) and where it is: ("optim", "lr_warmup_iters")
