"""Megatron-LM flags that megatron-epp accepts without acting on them (it does that anyway, or the flag only
tunes what megatron-epp does otherwise), and flags it refuses, each with its one-line reason; so a Megatron-LM
launch script runs with ``--elastic-pp`` added, and every flag it passes is either honoured, said to have no
effect (``--help`` and one start-up line), or refused before any work starts."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config reads ACCEPTED: the type only, no import cycle
    from megatron_epp.config.fields import TrainingConfig


@dataclass(frozen=True)
class Accepted:
    """A Megatron-LM flag taken for a script's sake; ``why``: what megatron-epp does instead (its help text)."""

    flag: str
    why: str
    kwargs: tuple[tuple[str, Any], ...] = (("action", "store_true"),)

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


ACCEPTED = (
    Accepted("--use-mcore-models", "the model is always megatron-core's GPTModel"),
    Accepted("--attention-softmax-in-fp32", "the attention softmax always runs in fp32 here (SDPA and flash-attn "
             "accumulate in fp32; megatron-core's own attention with its default attention_softmax_in_fp32)"),
    Accepted("--calculate-per-token-loss", "always on here: the loss is the sum of the global batch's token losses "
             "over its loss-masked token count (with --elastic-pp documents differ in length, so per token is the only "
             "consistent average)"),
    Accepted("--no-create-attention-mask-in-dataloader", "no attention mask is ever built by the data: attention is "
             "causal per document (--elastic-pp) or per sample"),
    Accepted("--no-gradient-accumulation-fusion", "never fused here (it needs Apex's fused weight-gradient kernel)"),
    Accepted("--no-async-tensor-model-parallel-allreduce", "megatron-core schedules the tensor-parallel all-reduce itself"),
    Accepted("--no-persist-layer-norm", "no effect: it turns off apex's persistent LayerNorm kernel in Megatron-LM, "
             "which is never used here (no apex); the fused RMSNorm kernels (EPP_FUSED_KERNELS, docs/gpu.md) have no "
             "persistent variant, and Megatron-LM's flag does not touch its RMSNorm either"),
    Accepted("--overlap-param-gather", "no effect: with --use-distributed-optimizer the parameters are all-gathered "
             "right after the optimizer step, not overlapped with the next forward (the same values)"),
    Accepted("--no-mmap-bin-files", "no effect: the indexed dataset's .bin is always memory-mapped (read on demand)"),
    Accepted("--num-workers", "no effect: samples are built in the training process, no DataLoader workers",
             (("type", int), ("default", None), ("metavar", "N"))),
    Accepted("--data-cache-path", "no effect: the sample order is built in memory at start-up, no index files are cached",
             (("default", None), ("metavar", "DIR"))),
    Accepted("--tiktoken-pattern", "no effect: read by Megatron-LM's TikTokenizer only (not supported here); "
             "ignored with other tokenizers, as Megatron-LM", (("default", None),)),
    Accepted("--transformer-impl", "no effect: the layer spec follows what imports (the stock path takes Transformer "
             "Engine's where transformer_engine.pytorch imports, else megatron-core's local spec; --elastic-pp always "
             "builds the local spec with its elastic attention); the start-up line '> layers:' says which",
             (("choices", ("local", "transformer_engine", "inference_optimized")), ("default", None))),
    Accepted("--dataloader-type", "no effect: megatron-epp's own samplers (one resumable order over the split; "
             "whole documents with --elastic-pp), no DataLoader", (("choices", ("single", "cyclic", "external")), ("default", None))),
    Accepted("--rerun-mode", "no effect: megatron-epp's own NaN/Inf check (--check-for-nan-in-loss-and-grad) stops the "
             "run before the update and names the rank", (("choices", ("disabled", "validate_results", "report_stats")), ("default", None))),
    Accepted("--distributed-backend", "no effect: NCCL on CUDA, gloo on CPU, chosen by the device",
             (("choices", ("nccl", "gloo")), ("default", None))),
)


class Refuse(argparse.Action):
    """A Megatron-LM flag megatron-epp does not implement: given, it is a one-line error with the reason
    (``help``'s text after "refused: "), whatever values follow it."""

    def __init__(self, option_strings, dest, why: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS,
                         help=f"refused: {why}".replace("%", "%%"), **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise argparse.ArgumentError(self, f"not supported here: {self.why}")


FP8 = ("fp8 needs Transformer Engine's layers, which megatron-epp does not build (with --elastic-pp the layers are "
       "megatron-core's local spec, the planner's memory model counts their tensors); train in --bf16")
REFUSED = {
    "--fp8-format": FP8, "--fp8-recipe": FP8, "--fp8-margin": FP8, "--fp8-interval": FP8,
    "--fp8-amax-history-len": FP8, "--fp8-amax-compute-algo": FP8, "--fp8-param-gather": FP8,
    "--use-torch-fsdp2": "FSDP is not supported; shard the optimizer states with --use-distributed-optimizer",
    "--use-megatron-fsdp": "FSDP is not supported; shard the optimizer states with --use-distributed-optimizer",
    "--num-experts": "mixture-of-experts models are not supported (the planner's cost model is for dense GPT/LLaMA layers)",
    "--no-save-optim": "every checkpoint holds the optimizer states (so that a resume is bit-identical); leave them out "
                       "at load with --no-load-optim",
    "--no-save-rng": "every checkpoint holds the random generators' states (so that a resume is bit-identical); leave "
                     "them out at load with --no-load-rng",
    "--window-size": "sliding-window attention is not supported: attention is causal over the whole document (a "
                     "split document's slices attend to all earlier slices), and the planner's cost model counts it so",
    "--use-checkpoint-args": "the model flags come from the command line; a checkpoint of another model shape or "
                             "parallel layout is refused in one line at --load",
}


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """The accepted and the refused Megatron-LM flags, in a group of their own."""
    group = parser.add_argument_group("Megatron-LM flags accepted without effect, or refused")
    for entry in ACCEPTED:
        group.add_argument(entry.flag, help=f"accepted: {entry.why}".replace("%", "%%"), **dict(entry.kwargs))
    for flag, why in REFUSED.items():
        group.add_argument(flag, action=Refuse, why=why)


def startup_notes(cfg: TrainingConfig) -> list[str]:
    """The start-up lines about Megatron-LM flags: what ``--micro-batch-size`` means with ``--elastic-pp``, and the
    accepted flags this command line gave that have no effect here (``cfg.accepted_flags``)."""
    notes = []
    if cfg.epp.enabled:
        notes.append(f"batch: --elastic-pp plans each step's {cfg.training.global_batch_size} documents (global batch) into "
                     "chunks, which replace micro-batches (the plan line counts them): --micro-batch-size is not used")
        if cfg.model.attention_backend == "fused":
            notes.append("--attention-backend fused: Transformer Engine's cuDNN attention is not used with --elastic-pp; "
                         "ElasticAttention's auto (flash-attn where it runs, else SDPA), the same attention")
    if cfg.parallel.dims.cp > 1:
        notes.append(f"context parallelism: --context-parallel-size {cfg.parallel.dims.cp} is Ulysses all-to-all here "
                     "(--cp-comm-type a2a, the only one): each chunk padded to a multiple of "
                     f"{cfg.parallel.dims.cp * (cfg.parallel.dims.tp if cfg.parallel.dims.sequence_parallel else 1)} tokens and "
                     f"split evenly over the {cfg.parallel.dims.cp} ranks of a stage, attention on every token for heads / "
                     f"{cfg.parallel.dims.cp}")
    if cfg.parallel.sequence_parallel_off_at_tp1:
        notes.append("--sequence-parallel at --tensor-model-parallel-size 1: turned off, as Megatron-LM does (it splits "
                     "activations over the tensor-parallel ranks, and there is one)")
    if cfg.accepted_flags:
        notes.append(f"Megatron-LM flags accepted with no effect here (see --help): {', '.join(cfg.accepted_flags)}")
    return notes
