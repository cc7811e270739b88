"""Command-line flags, with Megatron-LM's names, and their validation before any distributed work."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
from typing import Sequence

from megatron_epp.base.dims import ParallelDims
from megatron_epp.cost.clusters import get_cluster
from megatron_epp.cost.profiles import GIB
from megatron_epp.data.data_path import Blend, BlendError
from megatron_epp.data.tokenizers import TokenizerError, add_tokenizer_arguments, resolve_tokenizer_args, tokenizer_from_args
from megatron_epp.executor.kernels import load_flash_kernel
from megatron_epp.planner.config import CALIBRATE_FIRST_STEP, DEFAULT_CLUSTER, PlannerConfig, add_planner_arguments
from megatron_epp.training.config import TrainingConfig
from megatron_epp.training.extensions import probe_transformer_engine
from megatron_epp.training.megatron_flags import add_megatron_flags
from megatron_epp.training.memory_budget import CPU_FRACTION, CUDA_FRAGMENTATION_SHARE, CUDA_LIBRARY_MARGIN, default_memory_budget
import torch


class ArgumentError(ValueError):
    """A bad flag or flag combination; ``main`` prints it as one line and exits with status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(f"pretrain_gpt.py: error: {message}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ArgumentError(message)


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The model group."""
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4, help="transformer layers (default 4, a toy; Megatron-LM: required)")
    g.add_argument("--hidden-size", type=int, default=64, help="hidden size (default 64, a toy; Megatron-LM: required)")
    g.add_argument("--num-attention-heads", type=int, default=4,
                   help="query heads (default 4, a toy; Megatron-LM: required)")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default: 4 x hidden size; with --swiglu 8/3 x hidden size rounded down to a multiple of 64 (Megatron-LM's)")
    g.add_argument("--seq-length", type=int, default=128,
                   help="tokens per sample (default 128; Megatron-LM: required); with --elastic-pp the context cap: the "
                   "longest document trained (see --epp-truncate-documents), not a fixed sample length")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"], default="rope",
                   help="default rope (Megatron-LM: learned_absolute)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron-LM's older spelling of --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="no learned absolute position embedding, as Megatron-LM: with rope (the default here) there is "
                   "none anyway; with learned_absolute it is refused (position-free models are not supported, as in Megatron-LM)")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="the share of each head's channels RoPE rotates (default 1.0, as Megatron-LM)")
    g.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's (byte: 257)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary (embedding and output layer rows) up to a multiple of this x "
                        "--tensor-model-parallel-size, as Megatron-LM (the padded rows are never a label)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate input embedding and output layer weights (default: shared, as Megatron-LM)")
    g.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="dropout after attention and MLP (default 0.0; Megatron-LM: 0.1)")
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="dropout of the attention probabilities (default 0.0; Megatron-LM: 0.1)")
    g.add_argument("--init-method-std", type=float, default=0.02, help="weights' initial standard deviation (default 0.02)")
    # LLaMA-style architecture (Megatron-LM's names)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated SiLU: fc1 is 2 x --ffn-hidden-size wide)")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                   help="the layers' norm (default LayerNorm)")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="the norms' epsilon (default 1e-5)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centred norm weights, as Megatron-LM: the norm multiplies by (1 + weight), the weight "
                   "initialised to 0 (megatron-core's layernorm_zero_centered_gamma)")
    g.add_argument("--group-query-attention", action="store_true", help="grouped-query attention (needs --num-query-groups)")
    g.add_argument("--num-query-groups", type=int, default=None, help="K/V heads with --group-query-attention")
    g.add_argument("--kv-channels", type=int, default=None, help="head dimension (default: --hidden-size / --num-attention-heads)")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers")
    g.add_argument("--rotary-base", type=int, default=None, help=f"RoPE's base (theta; default {ROTARY_BASE})")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="LLaMA 3.x RoPE scaling (Hugging Face's rope_type llama3; megatron-core's rope_scaling): low "
                   "frequencies divided by --rope-scaling-factor, high ones kept, the band between interpolated")
    g.add_argument("--rope-scaling-factor", type=float, default=None, help="with --use-rope-scaling (default 8.0, as Megatron-LM)")
    g.add_argument("--rope-scaling-low-freq-factor", type=float, default=None,
                   help="with --use-rope-scaling: llama3's low_freq_factor (default 1.0, megatron-core's fixed value)")
    g.add_argument("--rope-scaling-high-freq-factor", type=float, default=None,
                   help="with --use-rope-scaling: llama3's high_freq_factor (default 4.0, megatron-core's fixed value)")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=None,
                   help="with --use-rope-scaling: llama3's original_max_position_embeddings, the context the model was "
                   "pretrained at (default 8192, megatron-core's fixed value)")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=float, default=None,
                   help="linear RoPE scaling (Hugging Face's rope_type linear): positions divided by this factor (megatron-core's "
                   "seq_len_interpolation_factor)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="with --elastic-pp, ElasticAttention's kernels: auto = flash-attn where it runs, else PyTorch's "
                   "SDPA; flash = flash-attn (an error where it cannot run); local, unfused = SDPA; fused = auto "
                   "(Transformer Engine's cuDNN attention is not used; said at start-up). Without --elastic-pp "
                   "megatron-core's: local = its own attention, flash/fused/unfused = Transformer Engine's (refused without "
                   "it), auto = Transformer Engine's choice where it is used (default auto)")
    g.add_argument("--use-flash-attn", action="store_const", const="flash", dest="attention_backend",
                   help="Megatron-LM's older spelling of --attention-backend flash")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                   help="without --elastic-pp, never megatron's fused masked softmax (by default it is used on CUDA where "
                   "it imports); ElasticAttention has none")


def _parallelism_flags(p: argparse.ArgumentParser) -> None:
    """The parallelism group."""
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel ranks (default 1)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages (default 1)")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="Megatron's interleaved schedule: not supported (the elastic schedule runs one model chunk per stage)")
    g.add_argument("--context-parallel-size", type=int, default=None,
                   help="context-parallel ranks per pipeline stage (with --elastic-pp; default 1): Ulysses, each chunk's tokens "
                   "split evenly over them (padded to a multiple), an all-to-all to heads / N around core attention")
    g.add_argument("--cp-comm-type", nargs="+", default=None,
                   help="context parallelism's communication: a2a (Ulysses, the only one implemented; also what "
                   "--context-parallel-size alone means here); p2p, allgather, a2a+p2p are refused")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism: activations outside attention split along the sequence over "
                   "the tensor-parallel ranks (needs --tensor-model-parallel-size > 1; with --elastic-pp each chunk is padded to a "
                   "multiple of it)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer states (and fp32 main params) over the data-parallel ranks (ZeRO-1)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce gradients bucket by bucket while the backward runs (DDP buckets)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="parameters per DDP gradient bucket with --overlap-grad-reduce "
                   "(default: megatron-core's, max(4e7, 1e6 x data parallel))")


def _batch_flags(p: argparse.ArgumentParser) -> None:
    """The batch group."""
    g = p.add_argument_group("batch")
    g.add_argument("--micro-batch-size", type=int, default=1,
                   help="samples per micro-batch (default 1; Megatron-LM: required); with --elastic-pp each step's "
                   "documents are planned into chunks, which replace micro-batches: the value is not used (said at start-up)")
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x data parallel")


def _optimisation_flags(p: argparse.ArgumentParser) -> None:
    """The optimisation group."""
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3; Megatron-LM: none)")
    g.add_argument("--min-lr", type=float, default=0.0, help="the learning rate the decay ends at (default 0.0)")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"], default="cosine",
                   help="learning-rate decay after the warm-up, megatron-core's OptimizerParamScheduler (default cosine; "
                   "Megatron-LM: linear); WSD: --lr until the last --lr-wsd-decay-iters/-samples of the decay, then "
                   "--lr-wsd-decay-style down to --min-lr")
    g.add_argument("--lr-wsd-decay-style", choices=["exponential", "linear", "cosine", "minus_sqrt"], default="exponential",
                   help="the annealing of --lr-decay-style WSD (default exponential, as Megatron-LM)")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="--lr-decay-style WSD: iterations of annealing")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="--lr-decay-style WSD with --train-samples: samples of annealing")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="warm-up iterations (default 0)")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay (--lr-decay-iters or --lr-decay-samples), as Megatron-LM; "
                   "instead of --lr-warmup-iters/-samples")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="the learning rate the warm-up (--lr-warmup-iters or --lr-warmup-samples) starts from (default 0.0)")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="with --train-samples: warm-up in samples")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="with --train-samples: decay in samples (default: --train-samples)")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="a separate peak learning rate for the input embedding and the output layer, as Megatron-LM")
    g.add_argument("--decoupled-min-lr", type=float, default=None, help="their --min-lr, with --decoupled-lr")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam", help="megatron-core's optimizer (default adam)")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="--optimizer sgd's momentum (default 0.9)")
    g.add_argument("--weight-decay", type=float, default=0.01,
                   help="weight decay of the weights (not biases and norms; default 0.01)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's beta1 (default 0.9)")
    g.add_argument("--adam-beta2", type=float, default=0.95, help="Adam's beta2 (default 0.95; Megatron-LM: 0.999)")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam's epsilon (default 1e-8)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient clipping by global norm (default 1.0; 0: off)")
    g.add_argument("--train-iters", type=int, default=None, help="default 20 (unless --train-samples)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="train this many samples (--elastic-pp: documents) instead of --train-iters: "
                   "floor(N / --global-batch-size) iterations, as Megatron-LM")
    g.add_argument("--seed", type=int, default=1234, help="random seed of initialisation, data order and dropout (default 1234)")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and activations (megatron-core's Float16Module), fp32 main parameters in the optimizer")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16, gradients accumulated and reduced in bf16 (default: in fp32)")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 parameters and activations with loss scaling (dynamic unless --loss-scale), fp32 main "
                   "parameters; a step whose scaled gradients overflow is skipped and the scale lowered, as Megatron-LM")
    g.add_argument("--loss-scale", type=float, default=None, help="--fp16: a fixed loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="--fp16: the dynamic scale's start (default 2^32)")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="--fp16: the dynamic scale's floor (default 1.0)")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="--fp16: steps without overflow before the dynamic scale doubles (default 1000)")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="--fp16: overflowing steps tolerated before the dynamic scale halves (default 2)")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector off during training, collected every --manual-gc-interval steps "
                   "(and around evaluations), as Megatron-LM: the same collection on every rank")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="--manual-gc: collect every N iterations (default 0: only at start and around evaluations)")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="--manual-gc: no collection around evaluations")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="on CUDA, release the allocator's cached blocks: 1 after each forward-backward, 2 also after the "
                   "optimizer step (default 0; no effect on CPU)")


def _recompute_flags(p: argparse.ArgumentParser) -> None:
    """The activation recompute group."""
    g = p.add_argument_group("activation recompute")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="without --elastic-pp: megatron-core's activation recompute (with it, the plan decides: --epp-recompute)")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="--recompute-granularity full: which layers are recomputed")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="--recompute-granularity full: layers per recomputed group (default 1)")


def _data_flags(p: argparse.ArgumentParser) -> None:
    """The data group."""
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="synthetic learnable sequences")
    g.add_argument("--data-path", nargs="+", default=None, metavar="[WEIGHT] PREFIX",
                   help="prefix of a Megatron indexed dataset (.bin/.idx), or a blend: WEIGHT PREFIX pairs (0.3 A 0.7 B)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights over documents (default 969,30,1)")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss on the token after an end-of-document token, as Megatron-LM; with --elastic-pp a document "
                   "never predicts past its end anyway")
    add_tokenizer_arguments(g)


def _elastic_flags(p: argparse.ArgumentParser) -> None:
    """The elastic pipeline parallelism group."""
    g = p.add_argument_group("elastic pipeline parallelism")
    g.add_argument("--elastic-pp", action="store_true",
                   help="whole documents per global batch, planned every step into batched/split/hybrid chunks")
    add_planner_arguments(g, {**EPP_DEFAULTS, "epp_memory_budget": f"the GPU's free memory at start-up less {CUDA_LIBRARY_MARGIN / GIB:.0f} GB and {CUDA_FRAGMENTATION_SHARE:.0%} of it, or {CPU_FRACTION:.0%} of RAM / ranks on CPU"})
    g.add_argument("--epp-profile-cache", default=None, metavar="DIR",
                   help="where --epp-profile auto keeps the profiles it measures on a GPU, one per GPU name, dtype, "
                   "attention kernel and layer shape (default $XDG_CACHE_HOME/megatron-epp/profiles, ~/.cache without it)")
    g.add_argument("--epp-truncate-documents", action="store_true",
                   help="train documents longer than --seq-length (the context cap) on their first --seq-length "
                   "tokens; without it such a document is an error before training")
    g.add_argument("--epp-timeline", default=None, help="directory: the planned timeline picture of every logged step")
    g.add_argument("--epp-calibrate-interval", type=int, default=None, metavar="N",
                   help="refit the planner's cost model to this machine (speed factor s and per-chunk stage overhead o) "
                   f"on the measured steps: after step {CALIBRATE_FIRST_STEP} (the first step of a run or a resumed run is "
                   f"warm-up and left out), then every N steps, on the last max(N, {CALIBRATE_FIRST_STEP - 1}) steps; and its "
                   "activation memory factor (the largest measured / predicted activation peak, at least 1) at the same "
                   "steps and at once after a step over --epp-memory-budget; saved "
                   f"in checkpoints; 0: off, the profile as given (default {CALIBRATE_INTERVAL})")


def _checkpointing_flags(p: argparse.ArgumentParser) -> None:
    """The checkpointing group."""
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to (iter_XXXXXXX/, as Megatron-LM)")
    g.add_argument("--load", default=None,
                   help="directory to resume from: its latest checkpoint whose files match the checksums recorded at save "
                   "(else the newest older one that does, saying so: see --no-ckpt-fallback); a directory with no "
                   "checkpoint yet, or none at all, starts from scratch with a warning (--save X --load X), as Megatron-LM")
    g.add_argument("--save-interval", type=int, default=None, help="save every N iterations (and at the end)")
    # Megatron-LM's load options, and the checksum fallback (megatron-epp's own)
    g.add_argument("--no-ckpt-fallback", dest="ckpt_fallback", action="store_false",
                   help="a damaged latest checkpoint (a file missing, of another size or failing its checksum) is an "
                   "error instead of falling back to the newest older checkpoint that verifies")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: exit with an error if the directory holds no checkpoint, instead of starting from scratch")
    g.add_argument("--no-load-optim", action="store_true",
                   help="do not load the optimizer states (nor, as Megatron-LM, the LR schedule's position) from the checkpoint")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the random number generators' states from the checkpoint")
    g.add_argument("--finetune", action="store_true",
                   help="load the model weights only: no optimizer, LR schedule or RNG state, and start at iteration 0, "
                   "sample 0 (as Megatron-LM)")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="with --use-distributed-optimizer: save its states in megatron-core's fully_reshardable format "
                   "(gathered over the data-parallel ranks at save, in model space), which loads at any other tensor and "
                   "pipeline size too; the default dp_reshardable format (each rank its own shard, no gather) reshards "
                   "over the data-parallel size only (as Megatron-LM)")
    g.add_argument("--ckpt-format", default="torch_dist",
                   help="torch_dist only: megatron-core's distributed checkpoint, what megatron-epp writes and reads "
                   "(Megatron-LM's default)")


def _fault_flags(p: argparse.ArgumentParser) -> None:
    """The preemption and faults group."""
    g = p.add_argument_group("preemption and faults")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (preemption, scancel, a SLURM --signal), every rank finishes the current step, "
                   "saves a checkpoint and exits 0 (needs --save)")
    g.add_argument("--exit-interval", type=int, default=None, metavar="N",
                   help="exit after an iteration divisible by N, saving when --save is given")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, metavar="M",
                   help="exit after the step during which M minutes since start passed, saving when --save is given")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0, metavar="M",
                   help="a collective that waits longer (a dead or hung rank) fails the job (default 10)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="a NaN/Inf loss or gradient stops the run before the update, naming the iteration and the rank "
                   "(default: on, as Megatron-LM; --no-check-for-nan-in-loss-and-grad turns it off)")


def _logging_flags(p: argparse.ArgumentParser) -> None:
    """The logging group."""
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1, help="iterations per log line (default 1; Megatron-LM: 100)")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="evaluate every N iterations (default: never; Megatron-LM: 1000)")
    g.add_argument("--eval-iters", type=int, default=2,
                   help="global batches per evaluation (default 2; Megatron-LM: 100); 0 turns evaluation off")
    g.add_argument("--tensorboard-dir", default=None, help="TensorBoard scalars: loss, lr, grad norm, tokens/s, "
                   "throughput, and with --elastic-pp the plan's statistics and per-stage memory")
    g.add_argument("--log-throughput", action="store_true",
                   help="model TFLOP/s per GPU in the log line (the tokens trained, causal attention per document)")
    g.add_argument("--wandb-project", default=None, help="log the same scalars to this wandb project (needs wandb)")
    g.add_argument("--wandb-exp-name", default=None, help="the wandb run's name (default: wandb's)")
    g.add_argument("--wandb-save-dir", default=None, help="wandb's local directory (default: SAVE/wandb with --save)")
    g.add_argument("--epp-metrics", default=None, metavar="FILE",
                   help="append one JSON record per logged step to FILE (default: metrics.jsonl in --tensorboard-dir, "
                        "else in --save; none without either)")


def _profiling_flags(p: argparse.ArgumentParser) -> None:
    """The profiling group (Megatron-LM's flags): iterations [--profile-step-start, --profile-step-end) of the
    --profile-ranks, for nsys or torch.profiler."""
    g = p.add_argument_group("profiling")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations [--profile-step-start, --profile-step-end) on --profile-ranks, as Megatron-LM: "
                   "cudaProfilerStart before the first and cudaProfilerStop after the last, NVTX ranges (emit_nvtx, "
                   "record_shapes) in between, for `nsys profile --capture-range=cudaProfilerApi "
                   "--capture-range-end=stop` (on CPU nothing to capture: said at start-up); with "
                   "--use-pytorch-profiler a torch.profiler trace instead. With --elastic-pp each chunk's forward and "
                   "backward is a named range: 'epp F p0 c3 split 4096t stage 1' (pipeline, chunk, kind, tokens, stage)")
    g.add_argument("--profile-step-start", type=int, default=None, metavar="N",
                   help=f"the first profiled iteration, numbered as in the log (default {PROFILE_STEPS[0]}, as Megatron-LM)")
    g.add_argument("--profile-step-end", type=int, default=None, metavar="N",
                   help=f"the iteration after the last profiled one (default {PROFILE_STEPS[1]}, as Megatron-LM)")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=None, metavar="RANK",
                   help="the global ranks that profile (default 0, as Megatron-LM)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile: torch.profiler on --profile-ranks (CPU activities, and CUDA's on a GPU; "
                   "record_shapes, with_stack), one trace per rank written under --tensorboard-dir by "
                   "torch.profiler.tensorboard_trace_handler (HOST_PID.TIME.pt.trace.json, named in a log line), as "
                   "Megatron-LM; needs --tensorboard-dir")


PROFILE_STEPS = (10, 12)  # Megatron-LM's --profile-step-start and --profile-step-end


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_gpt.py",
        description="Train a GPT with Megatron-Core pipeline parallelism (CPU/gloo or CUDA/NCCL). Flags have "
        "Megatron-LM's names and meanings; where a default differs from Megatron-LM's, the flag's help says so "
        "(\"Megatron-LM: ...\"); Megatron-LM flags that have no effect here, or are refused, are listed last.",
        allow_abbrev=False,
    )
    _model_flags(p)
    _parallelism_flags(p)
    _batch_flags(p)
    _optimisation_flags(p)
    _recompute_flags(p)
    _data_flags(p)
    _elastic_flags(p)
    _checkpointing_flags(p)
    _fault_flags(p)
    _logging_flags(p)
    _profiling_flags(p)
    add_megatron_flags(p)
    return p


def resolve_vocab_size(args: argparse.Namespace) -> None:
    """Load the ``--tokenizer-type`` tokenizer (a missing file or one that does not parse is a
    :class:`TokenizerError`) and fill or check ``--vocab-size``."""
    tokenizer = tokenizer_from_args(args)
    vocab, args.eod = tokenizer.vocab_size, tokenizer.eod
    if args.make_vocab_size_divisible_by < 1:
        raise ArgumentError(f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by}: must be >= 1")
    if args.vocab_size is None or args.tokenizer_type == "NullTokenizer":  # NullTokenizer: --vocab-size ids + its EOD
        args.vocab_size = vocab
    elif args.data_path is not None and args.vocab_size < vocab:
        raise ArgumentError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's {vocab} tokens")


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Parse and validate; raise :class:`ArgumentError` (one line, exit 2) on bad input."""
    args = build_parser().parse_args(argv)
    validate_args(args, world_size_from_env() if world_size is None else world_size)
    return args


def parse_config(argv: Sequence[str] | None = None, world_size: int | None = None) -> TrainingConfig:
    """The flags parsed, validated (:func:`parse_args`) and turned once into the typed configuration training reads."""
    return TrainingConfig.from_args(parse_args(argv, world_size))


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Fill derived values and check the combination; no process-group work needed."""
    validate_parallel_args(args, world_size)
    validate_model_args(args)
    validate_batch_args(args)
    validate_data_args(args)
    validate_exit_args(args)
    validate_recompute_args(args)
    validate_schedule_args(args)
    validate_profile_args(args, world_size)
    if not 0 <= args.lr_warmup_init <= args.lr:
        raise ArgumentError(f"--lr-warmup-init {args.lr_warmup_init}: must be between 0 and --lr {args.lr}")
    if args.epp_cluster and not args.epp_search_layout:
        raise ArgumentError("--epp-cluster applies only with --epp-search-layout")
    validate_elastic_args(args, world_size)


def validate_parallel_args(args: argparse.Namespace, world_size: int) -> None:
    """Sizes and ranges, Megatron-LM's flags, the parallel layout (fills ``data_parallel_size``), DDP's buckets; the
    metrics file's default."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ArgumentError("parallel sizes must be >= 1")
    if (args.train_iters is not None and args.train_iters < 1) or args.log_interval < 1:
        raise ArgumentError("--train-iters and --log-interval must be >= 1")
    validate_ranges(args)
    validate_megatron_args(args)
    if args.eval_iters == 0:  # Megatron-LM's way to turn evaluation off
        args.eval_interval = None
    for flag, value in UNSUPPORTED_PARALLELISM.items():
        if getattr(args, flag) not in (None, 1):
            raise ArgumentError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: {value}")
    cp = validate_context_parallel_args(args)
    try:
        args.data_parallel_size = ParallelDims.for_world(world_size, tp=tp, pp=pp, cp=cp).dp
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    validate_wandb_args(args)
    # as Megatron-LM (which warns): at tp 1 there is nothing to split the sequence over; a start-up line says so
    args.sequence_parallel_off_at_tp1 = bool(args.sequence_parallel and tp == 1)
    if args.sequence_parallel_off_at_tp1:
        args.sequence_parallel = False
    if args.sequence_parallel and not args.elastic_pp and args.seq_length % tp:
        raise ArgumentError(f"--sequence-parallel: --seq-length {args.seq_length} is not divisible by "
                            f"--tensor-model-parallel-size {tp} (each rank holds an equal share of every sample)")
    if args.ddp_bucket_size is not None and not args.overlap_grad_reduce:
        raise ArgumentError("--ddp-bucket-size applies only with --overlap-grad-reduce (without it DDP reduces all "
                            "gradients in one bucket after the backward)")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise ArgumentError(f"--ddp-bucket-size {args.ddp_bucket_size}: must be >= 1 parameters")
    if args.epp_metrics is None and (args.tensorboard_dir or args.save):
        args.epp_metrics = os.path.join(args.tensorboard_dir or args.save, "metrics.jsonl")


CP_COMM_TYPES = ("a2a",)  # implemented; Megatron-LM's others are refused in one line
CP_COMM_REFUSED = ("p2p", "allgather", "a2a+p2p")


def validate_context_parallel_args(args: argparse.Namespace) -> int:
    """``--context-parallel-size`` (fills it: 1 when not given) and ``--cp-comm-type`` (fills it: ``a2a`` under
    context parallelism, None without); returns the size."""
    cp = args.context_parallel_size = 1 if args.context_parallel_size is None else args.context_parallel_size
    if cp < 1:
        raise ArgumentError(f"--context-parallel-size {cp}: must be >= 1")
    kinds = args.cp_comm_type or []
    refused = [kind for kind in kinds if kind not in CP_COMM_TYPES]
    if refused:
        known = "not implemented" if refused[0] in CP_COMM_REFUSED else "unknown"
        raise ArgumentError(f"--cp-comm-type {refused[0]}: {known} here; context parallelism is Ulysses all-to-all (a2a) only")
    if len(kinds) > 1:
        raise ArgumentError(f"--cp-comm-type {' '.join(kinds)}: one type for every layer (a2a)")
    if cp > 1 and not args.elastic_pp:
        raise ArgumentError(f"--context-parallel-size {cp} needs --elastic-pp (megatron-core's own context parallelism "
                            "needs Transformer Engine's attention, which the stock path here does not build)")
    if cp > 1:
        heads = args.num_attention_heads // args.tensor_model_parallel_size
        if args.num_attention_heads % args.tensor_model_parallel_size == 0 and heads % cp:
            raise ArgumentError(f"--context-parallel-size {cp} does not divide the {heads} attention heads per tensor-parallel "
                                f"rank (--num-attention-heads {args.num_attention_heads} / --tensor-model-parallel-size "
                                f"{args.tensor_model_parallel_size}): the all-to-all gives each rank heads / {cp}")
    args.cp_comm_type = "a2a" if cp > 1 else None
    return cp


def validate_model_args(args: argparse.Namespace) -> None:
    """The model's shape against the layout (fills ``ffn_hidden_size``, ``max_position_embeddings``)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.num_layers % pp:
        raise ArgumentError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ArgumentError("--hidden-size must be divisible by --num-attention-heads (or give --kv-channels)")
    if args.num_attention_heads % tp:
        raise ArgumentError("--num-attention-heads must be divisible by --tensor-model-parallel-size")
    validate_architecture(args)
    if args.ffn_hidden_size is None:  # as Megatron-LM: SwiGLU's three GEMMs at the parameters of GELU's two, in multiples of 64
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
        if args.ffn_hidden_size < 1:
            raise ArgumentError(f"--swiglu with --hidden-size {args.hidden_size}: give --ffn-hidden-size (the default rounds 8/3 x hidden down to 64s: 0)")
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.max_position_embeddings < args.seq_length:
        raise ArgumentError("--max-position-embeddings is smaller than --seq-length")


def validate_batch_args(args: argparse.Namespace) -> None:
    """The global batch over micro-batches and data parallelism (fills ``global_batch_size``, ``num_microbatches``)."""
    # --elastic-pp: a step's documents are planned into chunks, not micro-batches (main's start-up line says so)
    per_step = (1 if args.elastic_pp else args.micro_batch_size) * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size {args.micro_batch_size} x data parallel {args.data_parallel_size}"
        )
    args.num_microbatches = args.global_batch_size // per_step


def validate_data_args(args: argparse.Namespace) -> None:
    """The tokenizer and vocabulary, ``--split``, and ``--mock-data`` or ``--data-path`` (fills ``data_blend``)."""
    try:
        resolve_tokenizer_args(args, "pretrain_gpt.py")
        resolve_vocab_size(args)
    except TokenizerError as error:
        raise ArgumentError(str(error)) from None
    validate_split(args)
    if args.mock_data == (args.data_path is not None):
        raise ArgumentError("give exactly one of --mock-data and --data-path")
    args.data_blend = None
    if args.data_path is not None:
        try:
            args.data_blend = Blend.parse(args.data_path)
        except BlendError as error:
            raise ArgumentError(str(error)) from None
        for prefix in args.data_blend.prefixes:
            missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                raise ArgumentError(f"--data-path {prefix}: missing {', '.join(prefix + m for m in missing)}")


def validate_exit_args(args: argparse.Namespace) -> None:
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


def validate_checkpoint_args(args: argparse.Namespace) -> None:
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


# the numeric flags' ranges, checked before anything divides by them (a None is a flag left to its default)
AT_LEAST_ONE = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "max_position_embeddings",
                "vocab_size", "micro_batch_size", "global_batch_size", "train_samples", "lr_decay_iters", "lr_decay_samples",
                "eval_interval", "save_interval")
AT_LEAST_ZERO = ("lr", "min_lr", "lr_warmup_iters", "lr_warmup_samples", "weight_decay", "clip_grad", "init_method_std",
                 "eval_iters", "decoupled_lr", "decoupled_min_lr", "adam_eps", "sgd_momentum", "manual_gc_interval",
                 "num_workers")
POSITIVE = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis", "lr_wsd_decay_iters",
            "lr_wsd_decay_samples")
PROBABILITIES = {"hidden_dropout": (0, 1, "]"), "attention_dropout": (0, 1, "]"), "adam_beta1": (0, 1, ")"),
                 "adam_beta2": (0, 1, ")"), "lr_warmup_fraction": (0, 1, ")")}


def validate_ranges(args: argparse.Namespace) -> None:
    """Each numeric flag in its range, named in the one-line error (``--num-layers 0: must be >= 1``)."""
    for flags, low in ((AT_LEAST_ONE, 1), (AT_LEAST_ZERO, 0)):
        for key in flags:
            value = getattr(args, key)
            if value is not None and not value >= low:  # `not >=`: a NaN fails too
                raise ArgumentError(f"--{key.replace('_', '-')} {value}: must be >= {low}")
    for key in POSITIVE:
        value = getattr(args, key)
        if value is not None and not value > 0:
            raise ArgumentError(f"--{key.replace('_', '-')} {value}: must be > 0")
    for key, (low, high, bracket) in PROBABILITIES.items():
        value = getattr(args, key)
        if value is None:
            continue
        if not (low <= value <= high if bracket == "]" else low <= value < high):
            raise ArgumentError(f"--{key.replace('_', '-')} {value}: must be in [{low}, {high}{bracket}")
    if args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")


ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")  # Megatron-LM's --attention-backend


def validate_megatron_args(args: argparse.Namespace) -> None:
    """The Megatron-LM flags of positions, precision, optimizer and housekeeping, as Megatron-LM checks them."""
    if args.use_rotary_position_embeddings:  # Megatron-LM's legacy flag overrides --position-embedding-type
        args.position_embedding_type = "rope"
    rope = args.position_embedding_type == "rope"
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
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentError("--overlap-param-gather applies only with --use-distributed-optimizer (as in Megatron-LM)")
    validate_attention_backend(args)


def validate_attention_backend(args: argparse.Namespace) -> None:
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


def validate_recompute_args(args: argparse.Namespace) -> None:
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
    if args.recompute_granularity == "full":
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        args.recompute_num_layers = 1 if args.recompute_num_layers is None else args.recompute_num_layers
        if not 1 <= args.recompute_num_layers <= per_stage:
            raise ArgumentError(f"--recompute-num-layers {args.recompute_num_layers}: must be between 1 and the "
                                f"{per_stage} layers of a pipeline stage")


def validate_schedule_args(args: argparse.Namespace) -> None:
    """Training length and LR schedule in iterations (``--train-iters``, ``--lr-*-iters``) or, as Megatron-LM, in
    samples (``--train-samples``, ``--lr-*-samples``), never mixed; fills ``train_iters`` and the schedule in
    samples (``lr_warmup_samples``, ``lr_decay_samples``), what the scheduler counts."""
    gbs = args.global_batch_size
    if args.train_samples is not None:
        if args.train_iters is not None:
            raise ArgumentError("--train-iters and --train-samples are mutually exclusive: give one")
        refuse_schedule_in_other_unit(args, "samples")
        args.train_iters = args.train_samples // gbs
        if args.train_iters < 1:
            raise ArgumentError(f"--train-samples {args.train_samples} is less than one --global-batch-size {gbs}")
        args.lr_decay_samples = args.lr_decay_samples or args.train_samples
        args.lr_wsd_decay_samples_total = args.lr_wsd_decay_samples
        validate_warmup_and_wsd(args, "samples")
        if args.lr_warmup_samples >= args.lr_decay_samples:
            raise ArgumentError(f"--lr-warmup-samples {args.lr_warmup_samples} must be smaller than --lr-decay-samples "
                                f"{args.lr_decay_samples} (default: --train-samples)")
        return
    refuse_schedule_in_other_unit(args, "iters")
    args.train_iters = args.train_iters or 20
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    args.lr_warmup_samples, args.lr_decay_samples = args.lr_warmup_iters * gbs, args.lr_decay_iters * gbs
    args.lr_wsd_decay_samples_total = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
    validate_warmup_and_wsd(args, "iters")
    if args.lr_warmup_samples >= args.lr_decay_samples:
        raise ArgumentError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
            f"{args.lr_decay_iters} (default: --train-iters)"
        )


def refuse_schedule_in_other_unit(args: argparse.Namespace, unit: str) -> None:
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


def validate_warmup_and_wsd(args: argparse.Namespace, unit: str) -> None:
    """``--lr-warmup-fraction`` (of the decay, instead of ``--lr-warmup-iters/-samples``) and ``--lr-decay-style WSD``'s
    annealing length, as Megatron-LM's scheduler takes them: in samples (``lr_warmup_samples``, a float as
    Megatron-LM's ``fraction x decay steps``; ``lr_wsd_decay_samples_total``)."""
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters or args.lr_warmup_samples:
            raise ArgumentError(f"--lr-warmup-fraction and --lr-warmup-{unit}: give one")
        args.lr_warmup_samples = args.lr_warmup_fraction * args.lr_decay_samples
    wsd_flag = f"--lr-wsd-decay-{unit}"
    if args.lr_decay_style != "WSD":
        if args.lr_wsd_decay_samples_total is not None:
            raise ArgumentError(f"{wsd_flag} applies only with --lr-decay-style WSD")
        return
    if args.lr_wsd_decay_samples_total is None:
        raise ArgumentError(f"--lr-decay-style WSD needs {wsd_flag} (the annealing at the end of the decay)")
    if args.lr_wsd_decay_samples_total > args.lr_decay_samples - args.lr_warmup_samples:
        raise ArgumentError(f"{wsd_flag} is longer than the decay after the warm-up (--lr-decay-{unit} less the warm-up)")


def validate_profile_args(args: argparse.Namespace, world_size: int) -> None:
    """``--profile``'s flags (fills the defaults of ``--profile-step-start/-end`` and ``--profile-ranks``): the
    iterations ``[start, end)``, counted as the log counts them, hold at least one of the run's; the ranks exist;
    ``--use-pytorch-profiler`` writes under ``--tensorboard-dir``. Without ``--profile`` none of them may be given."""
    given = [key for key in ("profile_step_start", "profile_step_end", "profile_ranks") if getattr(args, key) is not None]
    given += ["use_pytorch_profiler"] if args.use_pytorch_profiler else []
    if not args.profile:
        if given:
            raise ArgumentError(f"--{given[0].replace('_', '-')} needs --profile")
        return
    start = args.profile_step_start = PROFILE_STEPS[0] if args.profile_step_start is None else args.profile_step_start
    end = args.profile_step_end = PROFILE_STEPS[1] if args.profile_step_end is None else args.profile_step_end
    args.profile_ranks = (0,) if args.profile_ranks is None else tuple(args.profile_ranks)
    if start < 0:
        raise ArgumentError(f"--profile-step-start {start}: must be >= 0")
    if end <= start:
        raise ArgumentError(f"--profile-step-end {end} must be larger than --profile-step-start {start} (the profiled "
                            "iterations are start to end - 1)")
    if end <= 1 or start > args.train_iters:
        raise ArgumentError(f"--profile-step-start {start} --profile-step-end {end}: no iteration to profile (the run "
                            f"trains iterations 1 to {args.train_iters}; the profiled ones are start to end - 1)")
    outside = [rank for rank in args.profile_ranks if not 0 <= rank < world_size]
    if outside:
        raise ArgumentError(f"--profile-ranks {outside[0]}: no such rank (the ranks are 0 to {world_size - 1})")
    if args.use_pytorch_profiler and not args.tensorboard_dir:
        raise ArgumentError("--use-pytorch-profiler writes its trace under --tensorboard-dir, as Megatron-LM: give "
                            "--tensorboard-dir DIR")


SPLIT_WEIGHT = re.compile(r"\d+(\.\d*)?|\.\d+")  # what megatron-core's parse_and_normalize_split reads as one number


def validate_split(args: argparse.Namespace) -> None:
    """``--split``: 1 to 3 train,valid,test weights (missing ones 0), as megatron-core reads them; its parser would
    read ``1,-1,1`` as 1,1,1 and fail on a split without numbers only when the data is split."""
    # quotes kept by a shell array ("--split '99,1,0'", as Megatron-LM's LLaMA examples pass it) are not part of it
    parts = [part.strip() for part in re.split("[,/]", args.split.strip("'\""))]
    if not (len(parts) <= 3 and all(SPLIT_WEIGHT.fullmatch(p) for p in parts) and sum(map(float, parts)) > 0):
        raise ArgumentError(f"--split {args.split}: expected 1 to 3 non-negative train,valid,test weights separated "
                            "by commas (or slashes), not all 0, e.g. 969,30,1")


def validate_wandb_args(args: argparse.Namespace) -> None:
    if args.wandb_project is None:
        given = [f for f, v in (("--wandb-exp-name", args.wandb_exp_name), ("--wandb-save-dir", args.wandb_save_dir)) if v]
        if given:
            raise ArgumentError(f"{given[0]} needs --wandb-project")
        return
    if importlib.util.find_spec("wandb") is None:
        raise ArgumentError(f"--wandb-project {args.wandb_project}: wandb is not installed (pip install wandb, or drop "
                            "--wandb-project; --tensorboard-dir logs the same scalars)")
    if args.wandb_save_dir is None and args.save:
        args.wandb_save_dir = os.path.join(args.save, "wandb")


def validate_architecture(args: argparse.Namespace) -> None:
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
    args.rotary_base = args.rotary_base or ROTARY_BASE
    validate_rope_scaling(args)


ROPE_SCALING_DEFAULTS = {"rope_scaling_factor": 8.0, "rope_scaling_low_freq_factor": 1.0, "rope_scaling_high_freq_factor": 4.0,
                         "rope_scaling_original_max_position_embeddings": 8192}  # megatron-core's RotaryEmbedding


def validate_rope_scaling(args: argparse.Namespace) -> None:
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
    for key, default in ROPE_SCALING_DEFAULTS.items():
        value = default if getattr(args, key) is None else getattr(args, key)
        if not value > 0:
            raise ArgumentError(f"--{key.replace('_', '-')} {value}: must be > 0")
        setattr(args, key, value)
    if args.use_rope_scaling and not args.rope_scaling_high_freq_factor > args.rope_scaling_low_freq_factor:
        raise ArgumentError(f"--rope-scaling-high-freq-factor {args.rope_scaling_high_freq_factor}: must be above "
                            f"--rope-scaling-low-freq-factor {args.rope_scaling_low_freq_factor}")


ROTARY_BASE = 10000  # Megatron-LM's default RoPE base

UNSUPPORTED_PARALLELISM = {
    "virtual_pipeline_model_parallel_size": "the interleaved (virtual) pipeline schedule is not supported; "
    "--elastic-pp runs its own elastic 1F1B schedule with one model chunk per stage",
}


EPP_DEFAULTS = {  # pretrain_gpt.py's defaults of the planner options (epp-plan has its own)
    "epp_plan": PlannerConfig.builder, "epp_max_slices": 8, "epp_profile": "auto", "epp_recompute": PlannerConfig.recompute,
    "epp_time_limit": PlannerConfig.time_limit,
}

# --epp-* options that --epp-search-layout cannot honour: why
SEARCH_REFUSES = {
    "epp_profile": "it models the --epp-cluster preset's GPUs for the model the flags describe",
    "epp_timeline": "it prints a layout and exits without training",
    "epp_calibrate_interval": "it prints a layout and exits without training",
    "epp_profile_cache": "it models the --epp-cluster preset's GPUs for the model the flags describe",
}


CALIBRATE_INTERVAL = 20  # --epp-calibrate-interval's default (the first fit: after step CALIBRATE_FIRST_STEP)


def validate_elastic_args(args: argparse.Namespace, world_size: int) -> None:
    given = [k for k in (*EPP_DEFAULTS, "epp_memory_budget", "epp_timeline", "epp_calibrate_interval", "epp_profile_cache") if getattr(args, k) is not None]
    given += ["epp_truncate_documents"] if args.epp_truncate_documents else []
    args.epp_default_budget = None  # a given budget (or --epp-search-layout's preset) is kept as given
    if args.epp_search_layout:
        return validate_search_args(args, given)
    if not args.elastic_pp:
        if given:
            raise ArgumentError(f"--{given[0].replace('_', '-')} needs --elastic-pp")
        return
    for key, value in EPP_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.epp_memory_budget is None:
        args.epp_default_budget = default_memory_budget(world_size)
        args.epp_memory_budget = args.epp_default_budget.budget / GIB
    if args.epp_calibrate_interval is None:
        args.epp_calibrate_interval = CALIBRATE_INTERVAL
    if args.epp_calibrate_interval < 0:
        raise ArgumentError(f"--epp-calibrate-interval {args.epp_calibrate_interval}: must be >= 0 (0 turns calibration off)")
    try:
        PlannerConfig.from_args(args, args.seq_length)
    except ValueError as error:
        raise ArgumentError(str(error)) from None


def validate_search_args(args: argparse.Namespace, given: list[str]) -> None:
    """``--epp-search-layout``, with or without ``--elastic-pp``: the ``--epp-*`` planner options as given, else the
    driver's defaults; the budget ``--epp-memory-budget``, else the ``--epp-cluster`` preset's GPU memory (not this
    host's); one line for an option it cannot honour."""
    refused = [key for key in given if key in SEARCH_REFUSES]
    if refused:
        raise ArgumentError(f"--{refused[0].replace('_', '-')} does not apply with --epp-search-layout ({SEARCH_REFUSES[refused[0]]})")
    if args.epp_plan not in (None, PlannerConfig.builder):
        raise ArgumentError(f"--epp-plan {args.epp_plan}: --epp-search-layout searches EPP's ({PlannerConfig.builder}) layout")
    for key, value in EPP_DEFAULTS.items():
        if getattr(args, key) is None and key not in SEARCH_REFUSES:
            setattr(args, key, value)
    args.epp_cluster = args.epp_cluster or DEFAULT_CLUSTER
    if args.epp_memory_budget is None:
        args.epp_memory_budget = get_cluster(args.epp_cluster).memory_gb
    try:
        PlannerConfig.from_args(args, args.seq_length)
    except ValueError as error:
        raise ArgumentError(str(error)) from None


