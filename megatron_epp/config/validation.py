"""The validation that turns the options given (:mod:`.parser`) into the final configuration: each step reads the
config so far (read-only) and returns the values it fills (defaults that depend on other options, derived fields);
bad input is one :class:`~megatron_epp.config.errors.ArgumentError` line."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import fields

from megatron_epp.base.dims import CP_COMM_TYPE, ParallelDims
from megatron_epp.config.errors import ArgumentError
from megatron_epp.cost.clusters import get_cluster
from megatron_epp.cost.host import local_host_link
from megatron_epp.base.units import GIB
from megatron_epp.data.data_path import Blend, BlendError
from megatron_epp.data.tokenizers import TokenizerError, resolve_tokenizer_args, tokenizer_from_args
from megatron_epp.executor.kernels import block_kernel_problem, load_flash_kernel
from megatron_epp.base.option_tags import ELASTIC_ONLY, REFUSED_BY_SEARCH
from megatron_epp.base.options import Values, fields_tagged, key_of, range_problem, tag_values
from megatron_epp.planner.config import DEFAULT_CLUSTER, PlannerConfig, PlannerOptions
from megatron_epp.config.fields import CALIBRATE_INTERVAL, PROFILE_STEPS, ROTARY_BASE, TrainingConfig
from megatron_epp.executor.extensions import probe_transformer_engine
from megatron_epp.config import memory_budget
from megatron_epp.config.memory_budget import MemoryReading, default_memory_budget
import torch


EPP_DEFAULTS = {  # pretrain_gpt.py's defaults of the planner options (epp-plan has its own)
    "epp_plan": PlannerConfig.builder.flag, "epp_max_slices": 8, "epp_profile": "auto", "epp_recompute": PlannerConfig.recompute,
    "epp_time_limit": PlannerConfig.time_limit,
}


def resolve_vocab_size(args: Values) -> dict:
    """Load the ``--tokenizer-type`` tokenizer (a missing file or one that does not parse is a
    :class:`TokenizerError`): its end-of-document id, and ``--vocab-size`` filled or checked."""
    tokenizer = tokenizer_from_args(args)
    vocab = tokenizer.vocab_size
    if args.make_vocab_size_divisible_by < 1:
        raise ArgumentError(f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by}: must be >= 1")
    if args.vocab_size is None or args.tokenizer_type == "NullTokenizer":  # NullTokenizer: --vocab-size ids + its EOD
        return {"eod": tokenizer.eod, "vocab_size": vocab}
    if args.data_path is not None and args.vocab_size < vocab:
        raise ArgumentError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's {vocab} tokens")
    return {"eod": tokenizer.eod}


def validate(cfg: TrainingConfig, world_size: int, memory: MemoryReading | None = None) -> TrainingConfig:
    """The options as given turned into the final configuration: each step reads the config so far (read-only) and
    returns the values it fills (defaults that depend on other options, derived fields), which make the next config."""
    cfg = cfg.with_values(validate_parallel_args(cfg.values(), world_size))
    cfg = cfg.with_values(validate_model_args(cfg.values()))
    cfg = cfg.with_values(validate_batch_args(cfg.values()))
    cfg = cfg.with_values(validate_tokenizer_args(cfg.values()))
    cfg = cfg.with_values(validate_data_args(cfg.values()))
    validate_exit_args(cfg.values())
    cfg = cfg.with_values(validate_recompute_args(cfg.values()))
    cfg = cfg.with_values(validate_schedule_args(cfg.values()))
    cfg = cfg.with_values(validate_profile_args(cfg.values(), world_size))
    args = cfg.values()
    if not 0 <= args.lr_warmup_init <= args.lr:
        raise ArgumentError(f"--lr-warmup-init {args.lr_warmup_init}: must be between 0 and --lr {args.lr}")
    if args.epp_cluster and not args.epp_search_layout:
        raise ArgumentError("--epp-cluster applies only with --epp-search-layout")
    if args.epp_longest_document and not args.epp_search_layout:
        raise ArgumentError("--epp-longest-document applies only with --epp-search-layout")
    return cfg.with_values(validate_elastic_args(cfg.values(), world_size, memory))


def validate_parallel_args(args: Values, world_size: int) -> dict:
    """Sizes and ranges, Megatron-LM's flags, the parallel layout (``dims``: the data-parallel size the world leaves),
    DDP's buckets; the metrics file's default."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ArgumentError("parallel sizes must be >= 1")
    if (args.train_iters is not None and args.train_iters < 1) or args.log_interval < 1:
        raise ArgumentError("--train-iters and --log-interval must be >= 1")
    validate_ranges(args)
    changes = validate_megatron_args(args)
    if args.eval_iters == 0:  # Megatron-LM's way to turn evaluation off
        changes["eval_interval"] = None
    for flag, value in UNSUPPORTED_PARALLELISM.items():
        if getattr(args, flag) not in (None, 1):
            raise ArgumentError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: {value}")
    changes.update(validate_context_parallel_args(args))
    # as Megatron-LM (which warns): at tp 1 there is nothing to split the sequence over; a start-up line says so
    off_at_tp1 = changes["sequence_parallel_off_at_tp1"] = bool(args.sequence_parallel and tp == 1)
    sequence_parallel = changes["sequence_parallel"] = args.sequence_parallel and not off_at_tp1
    try:  # dp: what the world leaves
        changes["dims"] = ParallelDims.for_world(world_size, tp=tp, pp=pp, cp=changes["context_parallel_size"],
                                                 sequence_parallel=sequence_parallel)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    changes.update(validate_wandb_args(args))
    if sequence_parallel and not args.elastic_pp and args.seq_length % tp:
        raise ArgumentError(f"--sequence-parallel: --seq-length {args.seq_length} is not divisible by "
                            f"--tensor-model-parallel-size {tp} (each rank holds an equal share of every sample)")
    if args.ddp_bucket_size is not None and not args.overlap_grad_reduce:
        raise ArgumentError("--ddp-bucket-size applies only with --overlap-grad-reduce (without it DDP reduces all "
                            "gradients in one bucket after the backward)")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise ArgumentError(f"--ddp-bucket-size {args.ddp_bucket_size}: must be >= 1 parameters")
    if args.epp_metrics is None and (args.tensorboard_dir or args.save):
        changes["epp_metrics"] = os.path.join(args.tensorboard_dir or args.save, "metrics.jsonl")
    return changes


CP_COMM_TYPES = (CP_COMM_TYPE,)  # implemented; Megatron-LM's others are refused in one line
CP_COMM_REFUSED = ("p2p", "allgather", "a2a+p2p")


def validate_context_parallel_args(args: Values) -> dict:
    """``--context-parallel-size`` (filled: 1 when not given) and ``--cp-comm-type`` (filled: ``a2a`` under
    context parallelism, None without)."""
    cp = 1 if args.context_parallel_size is None else args.context_parallel_size
    if cp < 1:
        raise ArgumentError(f"--context-parallel-size {cp}: must be >= 1")
    kinds = args.cp_comm_type or []
    refused = [kind for kind in kinds if kind not in CP_COMM_TYPES]
    if refused:
        known = "not implemented" if refused[0] in CP_COMM_REFUSED else "unknown"
        raise ArgumentError(f"--cp-comm-type {refused[0]}: {known} here; context parallelism is Ulysses all-to-all ({CP_COMM_TYPE}) only")
    if len(kinds) > 1:
        raise ArgumentError(f"--cp-comm-type {' '.join(kinds)}: one type for every layer ({CP_COMM_TYPE})")
    if cp > 1 and not args.elastic_pp:
        raise ArgumentError(f"--context-parallel-size {cp} needs --elastic-pp (megatron-core's own context parallelism "
                            "needs Transformer Engine's attention, which the stock path here does not build)")
    if cp > 1:
        heads = args.num_attention_heads // args.tensor_model_parallel_size
        if args.num_attention_heads % args.tensor_model_parallel_size == 0 and heads % cp:
            raise ArgumentError(f"--context-parallel-size {cp} does not divide the {heads} attention heads per tensor-parallel "
                                f"rank (--num-attention-heads {args.num_attention_heads} / --tensor-model-parallel-size "
                                f"{args.tensor_model_parallel_size}): the all-to-all gives each rank heads / {cp}")
    return {"context_parallel_size": cp, "cp_comm_type": CP_COMM_TYPE if cp > 1 else None}


def validate_model_args(args: Values) -> dict:
    """The model's shape against the layout (fills ``ffn_hidden_size``, ``max_position_embeddings``)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.num_layers % pp:
        raise ArgumentError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ArgumentError("--hidden-size must be divisible by --num-attention-heads (or give --kv-channels)")
    if args.num_attention_heads % tp:
        raise ArgumentError("--num-attention-heads must be divisible by --tensor-model-parallel-size")
    changes = validate_architecture(args)
    ffn = args.ffn_hidden_size
    if ffn is None:  # as Megatron-LM: SwiGLU's three GEMMs at the parameters of GELU's two, in multiples of 64
        ffn = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
        if ffn < 1:
            raise ArgumentError(f"--swiglu with --hidden-size {args.hidden_size}: give --ffn-hidden-size (the default rounds 8/3 x hidden down to 64s: 0)")
    positions = args.max_position_embeddings or args.seq_length
    if positions < args.seq_length:
        raise ArgumentError("--max-position-embeddings is smaller than --seq-length")
    return {**changes, "ffn_hidden_size": ffn, "max_position_embeddings": positions}


def validate_batch_args(args: Values) -> dict:
    """The global batch over micro-batches and data parallelism (fills ``global_batch_size``, ``num_microbatches``)."""
    # --elastic-pp: a step's documents are planned into chunks, not micro-batches (main's start-up line says so)
    per_step = (1 if args.elastic_pp else args.micro_batch_size) * args.dims.dp
    gbs = per_step if args.global_batch_size is None else args.global_batch_size
    if gbs % per_step:
        raise ArgumentError(
            f"--global-batch-size {gbs} is not divisible by "
            f"--micro-batch-size {args.micro_batch_size} x data parallel {args.dims.dp}"
        )
    return {"global_batch_size": gbs, "num_microbatches": gbs // per_step}


def validate_tokenizer_args(args: Values) -> dict:
    """``--tokenizer-type`` (its default) and the deprecated ``--tokenizer``."""
    try:
        return resolve_tokenizer_args(args, "pretrain_gpt.py")
    except TokenizerError as error:
        raise ArgumentError(str(error)) from None


def validate_data_args(args: Values) -> dict:
    """The tokenizer and vocabulary, ``--split``, and ``--mock-data`` or ``--data-path`` (fills ``data_blend``)."""
    try:
        changes = resolve_vocab_size(args)
    except TokenizerError as error:
        raise ArgumentError(str(error)) from None
    validate_split(args)
    if args.mock_data == (args.data_path is not None):
        raise ArgumentError("give exactly one of --mock-data and --data-path")
    if args.data_path is not None:
        try:
            blend = changes["data_blend"] = Blend.parse(args.data_path)
        except BlendError as error:
            raise ArgumentError(str(error)) from None
        for prefix in blend.prefixes:
            missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                raise ArgumentError(f"--data-path {prefix}: missing {', '.join(prefix + m for m in missing)}")
    validate_sft_args(args)
    return changes


def validate_sft_args(args: Values) -> None:
    """``--sft``: with ``--elastic-pp`` (the stock path's fixed-length samples carry no loss masks) on ``--data-path``
    datasets of conversations (their masks are checked with the corpus, :mod:`~megatron_epp.training.corpus_check`)."""
    if not args.sft:
        return
    if not args.elastic_pp:
        raise ArgumentError("--sft needs --elastic-pp: conversations train as whole documents with their loss masks, which "
                            "the stock path's fixed-length samples do not carry")
    if args.mock_data:
        raise ArgumentError("--sft trains on conversations: give --data-path of datasets prepared with epp-prepare-data "
                            "--sft, not --mock-data")


def validate_exit_args(args: Values) -> None:
    """Checkpointing and the ways a run ends early (signal, interval, duration, timeout)."""
    validate_checkpoint_args(args)
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval needs --save")
    if args.exit_signal_handler and args.save is None:
        raise ArgumentError("--exit-signal-handler needs --save (it saves a checkpoint before exiting)")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ArgumentError(f"--exit-interval {args.exit_interval}: must be >= 1")
    for flag in ("exit_duration_in_mins", "distributed_timeout_minutes"):
        if getattr(args, flag) is not None and not getattr(args, flag) > 0:
            raise ArgumentError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be > 0")


def validate_checkpoint_args(args: Values) -> None:
    """``--ckpt-format`` and the load options (``--load`` of a directory not yet there is a first run: main warns)."""
    if args.ckpt_format != "torch_dist":
        raise ArgumentError(f"--ckpt-format {args.ckpt_format}: megatron-epp saves and loads torch_dist only "
                            "(megatron-core's distributed checkpoint, Megatron-LM's default)")
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        raise ArgumentError(f"--load {args.load}: not a directory")
    given = [f for f in ("no_load_optim", "no_load_rng", "finetune", "exit_on_missing_checkpoint") if getattr(args, f)]
    if given and args.load is None:
        raise ArgumentError(f"--{given[0].replace('_', '-')} needs --load")
    if args.dist_ckpt_optim_fully_reshardable and not args.use_distributed_optimizer:
        raise ArgumentError("--dist-ckpt-optim-fully-reshardable needs --use-distributed-optimizer "
                            "(the plain optimizer's checkpoint reshards to any layout as it is)")


def validate_ranges(args: Values) -> None:
    """Each numeric flag in its range (its field's: ``option(..., at_least=1)``), checked before anything divides by
    them (a None is a flag left to its default), named in the one-line error (``--num-layers 0: must be >= 1``)."""
    problem = range_problem(TrainingConfig, args)
    if problem:
        raise ArgumentError(problem)
    if args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")


def validate_megatron_args(args: Values) -> dict:
    """The Megatron-LM flags of positions, precision, optimizer and housekeeping, as Megatron-LM checks them; the
    position embedding type (``--use-rotary-position-embeddings``, Megatron-LM's legacy flag, overrides it)."""
    kind = "rope" if args.use_rotary_position_embeddings else args.position_embedding_type
    rope = kind == "rope"
    if not args.add_position_embedding and not rope:
        raise ArgumentError("--no-position-embedding with --position-embedding-type learned_absolute: a model without "
                            "positions is not supported (as in Megatron-LM); use rope")
    if not 0 < args.rotary_percent <= 1:
        raise ArgumentError(f"--rotary-percent {args.rotary_percent}: must be in (0, 1]")
    if args.rotary_percent != 1.0 and not rope:
        raise ArgumentError("--rotary-percent applies only with --position-embedding-type rope")
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16: give one")
    if args.loss_scale is not None and not args.fp16:
        raise ArgumentError("--loss-scale applies only with --fp16 (bf16 and fp32 train unscaled)")
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ArgumentError("--grad-reduce-in-bf16 needs --bf16")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ArgumentError("--decoupled-min-lr needs --decoupled-lr")
    if args.manual_gc_interval and not args.manual_gc:
        raise ArgumentError("--manual-gc-interval applies only with --manual-gc")
    if "--overlap-param-gather" in args.accepted_flags and not args.use_distributed_optimizer:
        raise ArgumentError("--overlap-param-gather applies only with --use-distributed-optimizer (as in Megatron-LM)")
    validate_attention_backend(args)
    return {"position_embedding_type": kind}


def validate_attention_backend(args: Values) -> None:
    """``--attention-backend``: with ``--elastic-pp`` ElasticAttention's request (flash: flash-attn, which must load;
    local, unfused: SDPA; auto, fused: its auto, the start-up line says so); without it megatron-core's, where
    flash, fused and unfused are Transformer Engine's attention and need it."""
    backend = args.attention_backend
    if args.elastic_pp and backend == "flash":
        kernel, why_not = load_flash_kernel()
        if kernel is None:
            raise ArgumentError(f"--attention-backend flash: {why_not} (auto takes flash-attn where it runs, else SDPA)")
    if not args.elastic_pp and backend in ("flash", "fused", "unfused"):
        why = "no CUDA device" if not torch.cuda.is_available() else probe_transformer_engine()
        if why:
            raise ArgumentError(f"--attention-backend {backend}: Transformer Engine's attention, not available here ({why}); "
                                "use auto or local")


def validate_recompute_args(args: Values) -> dict:
    """The ``--recompute-*`` flags as megatron-core's ``TransformerConfig`` checks them (there: after the process
    group exists); ``--recompute-num-layers`` defaults to 1 with ``--recompute-granularity full``. With
    ``--elastic-pp`` none applies: the plan decides recompute per chunk and stage (``--epp-recompute``)."""
    given = [key for key in ("recompute_granularity", "recompute_method", "recompute_num_layers") if getattr(args, key) is not None]
    if args.elastic_pp and given:
        raise ArgumentError(f"--{given[0].replace('_', '-')} does not apply with --elastic-pp (the plan decides recompute "
                            "per chunk: --epp-recompute)")
    if args.recompute_granularity == "full" and args.recompute_method is None:
        raise ArgumentError("--recompute-granularity full needs --recompute-method uniform|block")
    if args.recompute_method is not None and args.recompute_granularity != "full":
        raise ArgumentError("--recompute-method applies only with --recompute-granularity full")
    if args.recompute_num_layers is not None and args.recompute_granularity != "full":
        raise ArgumentError("--recompute-num-layers applies only with --recompute-granularity full (selective recomputes "
                            "the attention core of every layer)")
    if args.recompute_granularity != "full":
        return {}
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    layers = 1 if args.recompute_num_layers is None else args.recompute_num_layers
    if not 1 <= layers <= per_stage:
        raise ArgumentError(f"--recompute-num-layers {layers}: must be between 1 and the {per_stage} layers of a pipeline stage")
    return {"recompute_num_layers": layers}


def validate_schedule_args(args: Values) -> dict:
    """Training length and LR schedule in iterations (``--train-iters``, ``--lr-*-iters``) or, as Megatron-LM, in
    samples (``--train-samples``, ``--lr-*-samples``), never mixed; fills ``train_iters`` and the schedule in
    samples (``lr_warmup_samples``, ``lr_decay_samples``, ``lr_wsd_decay_samples_total``), what the scheduler counts."""
    gbs = args.global_batch_size
    if args.train_samples is not None:
        if args.train_iters is not None:
            raise ArgumentError("--train-iters and --train-samples are mutually exclusive: give one")
        refuse_schedule_in_other_unit(args, "samples")
        iters = args.train_samples // gbs
        if iters < 1:
            raise ArgumentError(f"--train-samples {args.train_samples} is less than one --global-batch-size {gbs}")
        decay = args.lr_decay_samples or args.train_samples
        warmup = validate_warmup_and_wsd(args, "samples", args.lr_warmup_samples, decay, args.lr_wsd_decay_samples)
        if warmup >= decay:
            raise ArgumentError(f"--lr-warmup-samples {warmup} must be smaller than --lr-decay-samples "
                                f"{decay} (default: --train-samples)")
        return {"train_iters": iters, "lr_decay_samples": decay, "lr_warmup_samples": warmup,
                "lr_wsd_decay_samples_total": args.lr_wsd_decay_samples}
    refuse_schedule_in_other_unit(args, "iters")
    iters = args.train_iters or 20
    decay_iters = args.lr_decay_iters or iters
    wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
    warmup = validate_warmup_and_wsd(args, "iters", args.lr_warmup_iters * gbs, decay_iters * gbs, wsd)
    if warmup >= decay_iters * gbs:
        raise ArgumentError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
            f"{decay_iters} (default: --train-iters)"
        )
    return {"train_iters": iters, "lr_decay_iters": decay_iters, "lr_warmup_samples": warmup, "lr_decay_samples": decay_iters * gbs,
            "lr_wsd_decay_samples_total": wsd}


def refuse_schedule_in_other_unit(args: Values, unit: str) -> None:
    """The LR schedule counts ``unit`` ("samples" with ``--train-samples``, else "iters"): a warm-up, decay or WSD
    length given in the other unit is one line naming the flag to give instead."""
    other = "iters" if unit == "samples" else "samples"
    given = [f"--lr-{name}-{other}" for name in ("warmup", "decay") if getattr(args, f"lr_{name}_{other}")]
    given += [f"--lr-wsd-decay-{other}"] if getattr(args, f"lr_wsd_decay_{other}") is not None else []
    if not given:
        return
    flag = given[0]
    instead = flag.replace(f"-{other}", f"-{unit}")
    if unit == "iters":
        raise ArgumentError(f"{flag} applies with --train-samples; with --train-iters give {instead}")
    raise ArgumentError(f"{flag} counts iterations; with --train-samples give "
                        + (instead if flag.startswith("--lr-wsd") else f"the schedule in samples ({instead})"))


def validate_warmup_and_wsd(args: Values, unit: str, warmup: float, decay: int, wsd: int | None) -> float:
    """``--lr-warmup-fraction`` (of the decay, instead of ``--lr-warmup-iters/-samples``) and ``--lr-decay-style WSD``'s
    annealing length ``wsd``, as Megatron-LM's scheduler takes them: in samples; returns the warm-up in samples (a
    float as Megatron-LM's ``fraction x decay steps``)."""
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters or args.lr_warmup_samples:
            raise ArgumentError(f"--lr-warmup-fraction and --lr-warmup-{unit}: give one")
        warmup = args.lr_warmup_fraction * decay
    wsd_flag = f"--lr-wsd-decay-{unit}"
    if args.lr_decay_style != "WSD":
        if wsd is not None:
            raise ArgumentError(f"{wsd_flag} applies only with --lr-decay-style WSD")
        return warmup
    if wsd is None:
        raise ArgumentError(f"--lr-decay-style WSD needs {wsd_flag} (the annealing at the end of the decay)")
    if wsd > decay - warmup:
        raise ArgumentError(f"{wsd_flag} is longer than the decay after the warm-up (--lr-decay-{unit} less the warm-up)")
    return warmup


def validate_profile_args(args: Values, world_size: int) -> dict:
    """``--profile``'s flags (fills the defaults of ``--profile-step-start/-end`` and ``--profile-ranks``): the
    iterations ``[start, end)``, counted as the log counts them, hold at least one of the run's; the ranks exist;
    ``--use-pytorch-profiler`` writes under ``--tensorboard-dir``. Without ``--profile`` none of them may be given."""
    given = [key for key in ("profile_step_start", "profile_step_end", "profile_ranks") if getattr(args, key) is not None]
    given += ["use_pytorch_profiler"] if args.use_pytorch_profiler else []
    if not args.profile:
        if given:
            raise ArgumentError(f"--{given[0].replace('_', '-')} needs --profile")
        return {}
    start = PROFILE_STEPS[0] if args.profile_step_start is None else args.profile_step_start
    end = PROFILE_STEPS[1] if args.profile_step_end is None else args.profile_step_end
    ranks = (0,) if args.profile_ranks is None else tuple(args.profile_ranks)
    if start < 0:
        raise ArgumentError(f"--profile-step-start {start}: must be >= 0")
    if end <= start:
        raise ArgumentError(f"--profile-step-end {end} must be larger than --profile-step-start {start} (the profiled "
                            "iterations are start to end - 1)")
    if end <= 1 or start > args.train_iters:
        raise ArgumentError(f"--profile-step-start {start} --profile-step-end {end}: no iteration to profile (the run "
                            f"trains iterations 1 to {args.train_iters}; the profiled ones are start to end - 1)")
    outside = [rank for rank in ranks if not 0 <= rank < world_size]
    if outside:
        raise ArgumentError(f"--profile-ranks {outside[0]}: no such rank (the ranks are 0 to {world_size - 1})")
    if args.use_pytorch_profiler and not args.tensorboard_dir:
        raise ArgumentError("--use-pytorch-profiler writes its trace under --tensorboard-dir, as Megatron-LM: give "
                            "--tensorboard-dir DIR")
    return {"profile_step_start": start, "profile_step_end": end, "profile_ranks": ranks}


SPLIT_WEIGHT = re.compile(r"\d+(\.\d*)?|\.\d+")  # what megatron-core's parse_and_normalize_split reads as one number


def validate_split(args: Values) -> None:
    """``--split``: 1 to 3 train,valid,test weights (missing ones 0), as megatron-core reads them; its parser would
    read ``1,-1,1`` as 1,1,1 and fail on a split without numbers only when the data is split."""
    # quotes kept by a shell array ("--split '99,1,0'", as Megatron-LM's LLaMA examples pass it) are not part of it
    parts = [part.strip() for part in re.split("[,/]", args.split.strip("'\""))]
    if not (len(parts) <= 3 and all(SPLIT_WEIGHT.fullmatch(p) for p in parts) and sum(map(float, parts)) > 0):
        raise ArgumentError(f"--split {args.split}: expected 1 to 3 non-negative train,valid,test weights separated "
                            "by commas (or slashes), not all 0, e.g. 969,30,1")


def validate_wandb_args(args: Values) -> dict:
    """The wandb flags (fills ``--wandb-save-dir``'s default)."""
    if args.wandb_project is None:
        given = [f for f, v in (("--wandb-exp-name", args.wandb_exp_name), ("--wandb-save-dir", args.wandb_save_dir)) if v]
        if given:
            raise ArgumentError(f"{given[0]} needs --wandb-project")
        return {}
    if importlib.util.find_spec("wandb") is None:
        raise ArgumentError(f"--wandb-project {args.wandb_project}: wandb is not installed (pip install wandb, or drop "
                            "--wandb-project; --tensorboard-dir logs the same scalars)")
    return {"wandb_save_dir": os.path.join(args.save, "wandb")} if args.wandb_save_dir is None and args.save else {}


def validate_architecture(args: Values) -> dict:
    """The LLaMA-style flags: grouped-query attention, head dimension, norm epsilon, rotary base."""
    heads, tp = args.num_attention_heads, args.tensor_model_parallel_size
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ArgumentError("--num-query-groups needs --group-query-attention")
    if args.group_query_attention:
        groups = args.num_query_groups
        if groups is None:
            raise ArgumentError("--group-query-attention needs --num-query-groups N")
        if groups < 1 or heads % groups:
            raise ArgumentError(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
        if groups % tp:
            raise ArgumentError(f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}")
    if args.kv_channels is not None and args.kv_channels < 1:
        raise ArgumentError(f"--kv-channels {args.kv_channels}: must be >= 1")
    if args.kv_channels is not None and args.position_embedding_type == "rope" and args.kv_channels % 2:
        raise ArgumentError(f"--kv-channels {args.kv_channels}: RoPE needs an even head dimension")
    if not args.norm_epsilon > 0:
        raise ArgumentError(f"--norm-epsilon {args.norm_epsilon}: must be > 0")
    if args.rotary_base is not None and args.position_embedding_type != "rope":
        raise ArgumentError("--rotary-base applies only with --position-embedding-type rope")
    if args.rotary_base is not None and args.rotary_base < 1:
        raise ArgumentError(f"--rotary-base {args.rotary_base}: must be >= 1")
    return {"rotary_base": args.rotary_base or ROTARY_BASE, **validate_rope_scaling(args)}


ROPE_SCALING_DEFAULTS = {"rope_scaling_factor": 8.0, "rope_scaling_low_freq_factor": 1.0, "rope_scaling_high_freq_factor": 4.0,
                         "rope_scaling_original_max_position_embeddings": 8192}  # megatron-core's RotaryEmbedding


def validate_rope_scaling(args: Values) -> dict:
    """``--use-rope-scaling`` and its parameters (filled with megatron-core's values), ``--rotary-seq-len-interpolation-factor``."""
    given = [k for k in ROPE_SCALING_DEFAULTS if getattr(args, k) is not None]
    if given and not args.use_rope_scaling:
        raise ArgumentError(f"--{given[0].replace('_', '-')} needs --use-rope-scaling")
    scaled = [f for f in ("use_rope_scaling", "rotary_seq_len_interpolation_factor") if getattr(args, f) not in (None, False)]
    if scaled and args.position_embedding_type != "rope":
        raise ArgumentError(f"--{scaled[0].replace('_', '-')} applies only with --position-embedding-type rope")
    if len(scaled) == 2:
        raise ArgumentError("--use-rope-scaling and --rotary-seq-len-interpolation-factor: one RoPE scaling at a time")
    if args.rotary_seq_len_interpolation_factor is not None and not args.rotary_seq_len_interpolation_factor >= 1:
        raise ArgumentError(f"--rotary-seq-len-interpolation-factor {args.rotary_seq_len_interpolation_factor}: must be >= 1")
    values = {key: default if getattr(args, key) is None else getattr(args, key) for key, default in ROPE_SCALING_DEFAULTS.items()}
    for key, value in values.items():
        if not value > 0:
            raise ArgumentError(f"--{key.replace('_', '-')} {value}: must be > 0")
    high, low = values["rope_scaling_high_freq_factor"], values["rope_scaling_low_freq_factor"]
    if args.use_rope_scaling and not high > low:
        raise ArgumentError(f"--rope-scaling-high-freq-factor {high}: must be above --rope-scaling-low-freq-factor {low}")
    return values


UNSUPPORTED_PARALLELISM = {
    "virtual_pipeline_model_parallel_size": "the interleaved (virtual) pipeline schedule is not supported; "
    "--elastic-pp runs its own elastic 1F1B schedule with one model chunk per stage",
}

# the --epp-* options that apply only with --elastic-pp or --epp-search-layout, and those --epp-search-layout cannot
# honour (with why): their fields' tags
ELASTIC_OPTIONS = fields_tagged(TrainingConfig, ELASTIC_ONLY)
SEARCH_REFUSES = tag_values(TrainingConfig, REFUSED_BY_SEARCH)


def validate_elastic_args(args: Values, world_size: int, memory: MemoryReading | None = None) -> dict:
    """The ``--epp-*`` options: given only with ``--elastic-pp`` or ``--epp-search-layout``; the planner's settings
    (``planner``), the driver's defaults where an option is not given, the budget in bytes (``default_budget``: how
    it was derived when ``--epp-memory-budget`` was not given, from ``memory``, else from the device read now)."""
    given = [k for k in ELASTIC_OPTIONS if getattr(args, k) is not None and getattr(args, k) is not False]
    if args.epp_search_layout:
        return validate_search_args(args, given)
    if not args.elastic_pp:
        if given:
            raise ArgumentError(f"--{given[0].replace('_', '-')} needs --elastic-pp")
        return {}
    default_budget = None
    if args.epp_memory_budget is None:
        default_budget = default_memory_budget(world_size, memory_budget.read_memory() if memory is None else memory)
    interval = CALIBRATE_INTERVAL if args.epp_calibrate_interval is None else args.epp_calibrate_interval
    if interval < 0:
        raise ArgumentError(f"--epp-calibrate-interval {interval}: must be >= 0 (0 turns calibration off)")
    planner = planner_config(args, EPP_DEFAULTS, None if default_budget is None else default_budget.budget)
    if planner.offload != "none":
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
        check_offload(planner, memory.device if memory is not None else ("cuda" if torch.cuda.is_available() else "cpu"), dtype)
    return {"planner": planner, "default_budget": default_budget, "epp_calibrate_interval": interval}


def check_offload(planner: PlannerConfig, device: str, dtype: torch.dtype = torch.float32) -> None:
    """``--epp-offload`` in training, before any work: the host budget per GPU within this node's host memory over its
    local ranks (``cost.host.local_host_link``), and on CUDA pinned host memory that can be allocated; one line each.
    ``auto`` (split sequences' K/V buffers on the host too, ``executor.kv_host``) runs where the block attention over
    the device window has its kernel (``kernels.block_kernel_problem``: CPU; CUDA in fp16/bf16 with torch's aten flash
    ops); ``dtype``: the model's (--bf16, --fp16, else fp32)."""
    problem = block_kernel_problem(torch.device(device), dtype) if planner.offload == "auto" else ""
    if problem:
        raise ArgumentError(f"--epp-offload auto on {device}: K/V buffers on the host need the block attention kernel over "
                            f"the device window, which cannot run here ({problem}): --epp-offload checkpoints")
    try:
        if planner.host_memory_budget_bytes is not None:
            local_host_link().check_budget(planner.host_memory_budget_bytes)
    except ValueError as error:
        raise ArgumentError(str(error)) from None
    if device == "cuda":
        try:
            torch.empty(1, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as error:
            raise ArgumentError(f"--epp-offload {planner.offload}: pinned host memory cannot be allocated here "
                                f"({' '.join(str(error).split())[:200]})") from None


def planner_config(args: Values, defaults: dict, budget_bytes: float | None) -> PlannerConfig:
    """The planner's settings: the ``--epp-*`` options given, else ``defaults`` (by dest); the budget
    ``budget_bytes`` where ``--epp-memory-budget`` is not given."""
    given = {f.name: getattr(args, key_of(f)) for f in fields(PlannerOptions)}
    options = PlannerOptions(**{f.name: defaults.get(key_of(f)) if given[f.name] is None else given[f.name]
                                for f in fields(PlannerOptions)})
    try:
        return PlannerConfig.from_options(options, args.seq_length, budget_bytes)
    except ValueError as error:
        raise ArgumentError(str(error)) from None


def validate_search_args(args: Values, given: list[str]) -> dict:
    """``--epp-search-layout``, with or without ``--elastic-pp``: the ``--epp-*`` planner options as given, else the
    driver's defaults; the budget ``--epp-memory-budget``, else the ``--epp-cluster`` preset's GPU memory (not this
    host's); one line for an option it cannot honour."""
    refused = [key for key in given if key in SEARCH_REFUSES]
    if refused:
        raise ArgumentError(f"--{refused[0].replace('_', '-')} does not apply with --epp-search-layout ({SEARCH_REFUSES[refused[0]]})")
    if args.epp_plan not in (None, PlannerConfig.builder.flag):
        raise ArgumentError(f"--epp-plan {args.epp_plan}: --epp-search-layout searches EPP's ({PlannerConfig.builder.flag}) layout")
    cluster = args.epp_cluster or DEFAULT_CLUSTER
    budget = get_cluster(cluster).memory_gb * GIB if args.epp_memory_budget is None else None
    defaults = {key: value for key, value in EPP_DEFAULTS.items() if key not in SEARCH_REFUSES}
    return {"epp_cluster": cluster, "planner": planner_config(args, defaults, budget)}
