"""Command-line flags, with Megatron-LM's names, and their validation before any distributed work."""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from megatron_epp.planner.config import PlannerConfig, add_planner_arguments
import psutil
import torch


class ArgumentError(ValueError):
    """A bad flag or flag combination; ``main`` prints it as one line and exits with status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(f"pretrain_gpt.py: error: {message}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ArgumentError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_gpt.py",
        description="Train a GPT with Megatron-Core pipeline parallelism (CPU/gloo or CUDA/NCCL).",
        allow_abbrev=False,
    )
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"], default="rope")
    g.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's (byte: 257)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="Megatron's interleaved schedule: not supported (the elastic schedule runs one model chunk per stage)")
    g.add_argument("--context-parallel-size", type=int, default=None,
                   help="not supported: EPP splits long sequences along the pipeline instead")

    g = p.add_argument_group("batch")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x data parallel")

    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"], default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")

    g = p.add_argument_group("activation recompute")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="synthetic learnable sequences")
    g.add_argument("--data-path", default=None, help="prefix of a Megatron indexed dataset (.bin/.idx)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights over documents")
    g.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json (sets the vocab size)")

    g = p.add_argument_group("elastic pipeline parallelism")
    g.add_argument("--elastic-pp", action="store_true",
                   help="whole documents per global batch, planned every step into batched/split/hybrid chunks")
    add_planner_arguments(g, {**EPP_DEFAULTS, "epp_memory_budget": "90% of GPU memory, or of RAM / ranks on CPU"})
    g.add_argument("--epp-truncate-documents", action="store_true",
                   help="train documents longer than --seq-length (the context cap) on their first --seq-length "
                   "tokens; without it such a document is an error before training")
    g.add_argument("--epp-timeline", default=None, help="directory: the planned timeline picture of every logged step")
    g.add_argument("--epp-calibrate-interval", type=int, default=None, metavar="N",
                   help="refit the planner's cost model to this machine (speed factor s and per-chunk stage overhead o) "
                   f"on the measured steps: after step {CALIBRATE_FIRST_STEP} (step 1 is warm-up and left out), then "
                   f"every N steps, on the last max(N, {CALIBRATE_FIRST_STEP - 1}) steps; 0: off, the profile as given "
                   f"(default {CALIBRATE_INTERVAL})")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=2)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--epp-metrics", default=None, metavar="FILE",
                   help="append one JSON record per logged step to FILE (default: metrics.jsonl in --tensorboard-dir, "
                        "else in --save; none without either)")
    return p


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Parse and validate; raise :class:`ArgumentError` (one line, exit 2) on bad input."""
    args = build_parser().parse_args(argv)
    validate_args(args, world_size_from_env() if world_size is None else world_size)
    return args


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Fill derived values and check the combination; no process-group work needed."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ArgumentError("parallel sizes must be >= 1")
    if args.train_iters < 1 or args.log_interval < 1:
        raise ArgumentError("--train-iters and --log-interval must be >= 1")
    for flag, value in UNSUPPORTED_PARALLELISM.items():
        if getattr(args, flag) not in (None, 1):
            raise ArgumentError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: {value}")
    if world_size % (tp * pp):
        raise ArgumentError(f"world size {world_size} is not divisible by tp {tp} x pp {pp}")
    args.data_parallel_size = world_size // (tp * pp)
    if args.epp_metrics is None and (args.tensorboard_dir or args.save):
        args.epp_metrics = os.path.join(args.tensorboard_dir or args.save, "metrics.jsonl")
    if args.num_layers % pp:
        raise ArgumentError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.hidden_size % args.num_attention_heads:
        raise ArgumentError("--hidden-size must be divisible by --num-attention-heads")
    if args.num_attention_heads % tp:
        raise ArgumentError("--num-attention-heads must be divisible by --tensor-model-parallel-size")
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.max_position_embeddings < args.seq_length:
        raise ArgumentError("--max-position-embeddings is smaller than --seq-length")
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size {args.micro_batch_size} x data parallel {args.data_parallel_size}"
        )
    args.num_microbatches = args.global_batch_size // per_step
    if args.mock_data == (args.data_path is not None):
        raise ArgumentError("give exactly one of --mock-data and --data-path")
    if args.data_path is not None:
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(args.data_path + ext)]
        if missing:
            raise ArgumentError(f"--data-path {args.data_path}: missing {', '.join(args.data_path + m for m in missing)}")
    if args.load is not None and not os.path.isdir(args.load):
        raise ArgumentError(f"--load {args.load}: no such directory")
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval needs --save")
    if args.recompute_granularity == "full" and args.recompute_method is None:
        raise ArgumentError("--recompute-granularity full needs --recompute-method uniform|block")
    if args.recompute_method is not None and args.recompute_granularity != "full":
        raise ArgumentError("--recompute-method applies only with --recompute-granularity full")
    if args.recompute_method is not None:
        args.recompute_num_layers = args.recompute_num_layers or 1
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ArgumentError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
            f"{args.lr_decay_iters} (default: --train-iters)"
        )
    if args.epp_cluster and not args.epp_search_layout:
        raise ArgumentError("--epp-cluster applies only with --epp-search-layout")
    validate_elastic_args(args, world_size)


UNSUPPORTED_PARALLELISM = {
    "virtual_pipeline_model_parallel_size": "the interleaved (virtual) pipeline schedule is not supported; "
    "--elastic-pp runs its own elastic 1F1B schedule with one model chunk per stage",
    "context_parallel_size": "context parallelism is not supported; --elastic-pp cuts long sequences into "
    "slices that flow through the pipeline instead (see --epp-max-slices)",
}


EPP_DEFAULTS = {  # pretrain_gpt.py's defaults of the planner options (epp-plan has its own)
    "epp_plan": "elastic", "epp_max_slices": 8, "epp_profile": "test-model", "epp_recompute": "adaptive", "epp_time_limit": 0.1,
}


# --epp-calibrate-interval: the first fit after this step (the first step is warm-up: lazy initialisation,
# first-touch allocations), on the steps after the warm-up; then every --epp-calibrate-interval steps
CALIBRATE_FIRST_STEP = 5
CALIBRATE_INTERVAL = 20


def validate_elastic_args(args: argparse.Namespace, world_size: int) -> None:
    given = [k for k in (*EPP_DEFAULTS, "epp_memory_budget", "epp_timeline", "epp_calibrate_interval") if getattr(args, k) is not None]
    given += ["epp_truncate_documents"] if args.epp_truncate_documents else []
    if not args.elastic_pp:
        if given:
            raise ArgumentError(f"--{given[0].replace('_', '-')} needs --elastic-pp")
        return
    if args.recompute_granularity is not None:
        raise ArgumentError("--recompute-granularity does not apply with --elastic-pp (the plan decides recompute per chunk)")
    if args.micro_batch_size != 1:
        raise ArgumentError("--micro-batch-size does not apply with --elastic-pp (chunks are planned per step)")
    for key, value in EPP_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.epp_memory_budget is None:
        args.epp_memory_budget = default_memory_budget_gb(world_size)
    if args.epp_calibrate_interval is None:
        args.epp_calibrate_interval = CALIBRATE_INTERVAL
    if args.epp_calibrate_interval < 0:
        raise ArgumentError(f"--epp-calibrate-interval {args.epp_calibrate_interval}: must be >= 0 (0 turns calibration off)")
    try:
        PlannerConfig.from_args(args, args.seq_length)
    except ValueError as error:
        raise ArgumentError(str(error)) from None


def default_memory_budget_gb(world_size: int) -> float:
    if torch.cuda.is_available():
        return 0.9 * torch.cuda.get_device_properties(0).total_memory / 1024**3
    return 0.9 * psutil.virtual_memory().total / world_size / 1024**3
