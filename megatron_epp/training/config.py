"""The typed training configuration: ``pretrain_gpt.py``'s flags, once validated, as one frozen
:class:`TrainingConfig` of sections (model, parallel, optim, training, data, checkpoint, logging, profile, epp).

The flags keep Megatron-LM's names (``arguments.py`` parses and validates them into an
``argparse.Namespace``); :meth:`TrainingConfig.from_args` turns that namespace into this value once, and
the rest of training reads only the sections. A field has its flag's name (``--lr-decay-style`` is
``optim.lr_decay_style``), less the ``epp_`` prefix in the ``epp`` section (``--epp-timeline`` is
``epp.timeline``) and ``profile_`` in the ``profile`` section (``--profile-step-start`` is
``profile.step_start``). The parallel sizes are one :class:`~megatron_epp.base.dims.ParallelDims`
(``parallel.dims``) and the planner's options one :class:`~megatron_epp.planner.config.PlannerConfig`
(``epp.planner``, the memory budget in bytes). A flag that validation folds into another (an older
spelling, a size in iterations the schedule counts in samples) is listed in :data:`FOLDED` with where it
went; :func:`unplaced_flags` is what a test checks: every flag lands somewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from megatron_epp.base.dims import ParallelDims
from megatron_epp.data.data_path import Blend
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.training.megatron_flags import ACCEPTED
from megatron_epp.training.memory_budget import DefaultBudget


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, architecture, precision and megatron-core's own activation recompute."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    max_position_embeddings: int
    vocab_size: int
    make_vocab_size_divisible_by: int
    position_embedding_type: str
    add_position_embedding: bool
    rotary_base: int
    rotary_percent: float
    use_rope_scaling: bool
    rope_scaling_factor: float
    rope_scaling_low_freq_factor: float
    rope_scaling_high_freq_factor: float
    rope_scaling_original_max_position_embeddings: int
    rotary_seq_len_interpolation_factor: float | None
    untie_embeddings_and_output_weights: bool
    hidden_dropout: float
    attention_dropout: float
    init_method_std: float
    swiglu: bool
    normalization: str
    norm_epsilon: float
    apply_layernorm_1p: bool
    group_query_attention: bool
    num_query_groups: int | None
    kv_channels: int | None
    disable_bias_linear: bool
    attention_backend: str
    masked_softmax_fusion: bool
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    bf16: bool
    fp16: bool

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def kv_heads(self) -> int | None:
        """K/V heads with grouped-query attention, else None (as many as query heads)."""
        return self.num_query_groups if self.group_query_attention else None


@dataclass(frozen=True)
class ParallelConfig:
    """The layout (``dims``: tp, pp, dp, sequence parallelism, world size) and the data-parallel machinery."""

    dims: ParallelDims
    use_distributed_optimizer: bool
    overlap_grad_reduce: bool
    ddp_bucket_size: int | None
    distributed_timeout_minutes: float
    sequence_parallel_off_at_tp1: bool  # --sequence-parallel given at tp 1: turned off, a start-up line says so


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer, the learning-rate schedule (in samples, as megatron-core's scheduler counts) and fp16's
    loss scaling."""

    optimizer: str
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_wsd_decay_style: str
    lr_warmup_init: float
    lr_warmup_samples: float
    lr_decay_samples: int
    lr_wsd_decay_samples_total: int | None
    decoupled_lr: float | None
    decoupled_min_lr: float | None
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    clip_grad: float
    grad_reduce_in_bf16: bool
    loss_scale: float | None
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: float
    hysteresis: int


@dataclass(frozen=True)
class TrainingSection:
    """The run: its length, batch, seed, garbage collection, checks and exit conditions."""

    train_iters: int
    train_samples: int | None
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    seed: int
    manual_gc: bool
    manual_gc_interval: int
    manual_gc_eval: bool
    empty_unused_memory_level: int
    check_for_nan_in_loss_and_grad: bool
    exit_signal_handler: bool
    exit_interval: int | None
    exit_duration_in_mins: float | None


@dataclass(frozen=True)
class DataConfig:
    """The corpus (mock, or a blend of indexed datasets), its split and the tokenizer."""

    mock_data: bool
    data_path: list[str] | None
    data_blend: Blend | None
    split: str
    eod_mask_loss: bool
    eod: int  # the tokenizer's end-of-document id
    tokenizer_type: str
    tokenizer_model: str | None
    vocab_file: str | None
    merge_file: str | None
    eod_token: str | None


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None
    load: str | None
    save_interval: int | None
    ckpt_fallback: bool
    exit_on_missing_checkpoint: bool
    no_load_optim: bool
    no_load_rng: bool
    finetune: bool
    dist_ckpt_optim_fully_reshardable: bool
    ckpt_format: str


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    eval_interval: int | None
    eval_iters: int
    tensorboard_dir: str | None
    log_throughput: bool
    wandb_project: str | None
    wandb_exp_name: str | None
    wandb_save_dir: str | None
    epp_metrics: str | None  # --epp-metrics: the JSON-lines file (its default filled in by validation)


@dataclass(frozen=True)
class ProfileConfig:
    """``--profile`` (``enabled``): the iterations ``[step_start, step_end)`` (as the log counts them) of the
    ``ranks`` that profile, under nsys or, with ``--use-pytorch-profiler``, torch.profiler."""

    enabled: bool = field(metadata={"dest": "profile"})
    step_start: int | None  # None without --profile
    step_end: int | None
    ranks: tuple[int, ...] | None
    use_pytorch_profiler: bool = field(metadata={"dest": "use_pytorch_profiler"})


@dataclass(frozen=True)
class EPPConfig:
    """``--elastic-pp`` (``enabled``) and the ``--epp-*`` options; ``planner``: the planner's options (with
    ``--elastic-pp`` or ``--epp-search-layout``, else None), its budget in bytes; ``default_budget``: how the budget
    was derived when ``--epp-memory-budget`` was not given (None where it was)."""

    enabled: bool = field(metadata={"dest": "elastic_pp"})
    planner: PlannerConfig | None
    profile_cache: str | None
    truncate_documents: bool
    timeline: str | None
    calibrate_interval: int | None
    search_layout: bool
    cluster: str | None
    default_budget: DefaultBudget | None


@dataclass(frozen=True)
class TrainingConfig:
    """Everything a training run reads, made once by :meth:`from_args` after the flags are validated."""

    model: ModelConfig
    parallel: ParallelConfig
    optim: OptimConfig
    training: TrainingSection
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    profile: ProfileConfig
    epp: EPPConfig
    accepted_flags: tuple[str, ...] = ()  # Megatron-LM flags given that have no effect here (the start-up line)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainingConfig":
        """From the namespace :func:`~megatron_epp.training.arguments.parse_args` returns (validated, derived
        values filled in)."""
        planner = PlannerConfig.from_args(args, args.seq_length) if args.elastic_pp or args.epp_search_layout else None
        dims = ParallelDims(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size,
                            args.context_parallel_size, args.sequence_parallel)  # data_parallel_size: validation's
        special = {"dims": dims, "planner": planner, "search_layout": bool(args.epp_search_layout)}
        sections = {name: _section(kind, args, special) for name, kind in get_type_hints(cls).items() if name != "accepted_flags"}
        accepted = tuple(entry.flag for entry in ACCEPTED if getattr(args, entry.dest) not in (None, False))
        return cls(**sections, accepted_flags=accepted)

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
                inner = dataclasses.asdict(item) if dataclasses.is_dataclass(item) else {"": item}
                for key, v in inner.items():
                    plain = v if isinstance(v, (bool, int, float, str, list, type(None))) else str(v)
                    out[f"{section.name}.{f.name}" + (f".{key}" if key else "")] = plain
        return out


SECTION_PREFIX = {"EPPConfig": "epp_", "ProfileConfig": "profile_"}  # the flags of these sections are --epp-NAME (--profile-NAME); the field is NAME
SECTIONS = (ModelConfig, ParallelConfig, OptimConfig, TrainingSection, DataConfig, CheckpointConfig, LoggingConfig, ProfileConfig,
            EPPConfig)


def _dest(section: type, f: dataclasses.Field) -> str:
    return f.metadata.get("dest", SECTION_PREFIX.get(section.__name__, "") + f.name)


def _section(section: type, args: argparse.Namespace, special: dict[str, Any]) -> Any:
    return section(**{f.name: special[f.name] if f.name in special else getattr(args, _dest(section, f))
                      for f in fields(section)})


# Flags that validation folds into others, and where they went (so no flag is silently dropped)
FOLDED = {
    "tensor_model_parallel_size": "parallel.dims.tp", "pipeline_model_parallel_size": "parallel.dims.pp",
    "data_parallel_size": "parallel.dims.dp", "sequence_parallel": "parallel.dims.sequence_parallel",
    "virtual_pipeline_model_parallel_size": "refused unless 1", "context_parallel_size": "parallel.dims.cp",
    "cp_comm_type": "a2a, the only one (parallel.dims.cp > 1)",
    "use_rotary_position_embeddings": "model.position_embedding_type", "tokenizer": "data.tokenizer_type/tokenizer_model",
    "lr_warmup_iters": "optim.lr_warmup_samples", "lr_warmup_fraction": "optim.lr_warmup_samples",
    "lr_decay_iters": "optim.lr_decay_samples", "lr_wsd_decay_iters": "optim.lr_wsd_decay_samples_total",
    "lr_wsd_decay_samples": "optim.lr_wsd_decay_samples_total",
    "epp_memory_budget": "epp.planner.memory_budget_bytes", "epp_plan": "epp.planner.builder",
    "epp_profile": "epp.planner.profile", "epp_recompute": "epp.planner.recompute",
    "epp_max_slices": "epp.planner.max_slices", "epp_time_limit": "epp.planner.time_limit",
}


def placed_dests() -> set[str]:
    """The namespace names :meth:`TrainingConfig.from_args` reads into a field."""
    return {_dest(section, f) for section in SECTIONS for f in fields(section) if f.name not in ("dims", "planner")}  # search_layout: its dest, made a bool


def unplaced_flags(args: argparse.Namespace) -> list[str]:
    """The names in a parsed namespace that land nowhere in the config: a flag added without its field."""
    accepted = {entry.dest for entry in ACCEPTED}
    return sorted(set(vars(args)) - placed_dests() - set(FOLDED) - accepted)
