"""``pretrain_gpt.py``: argument parsing, set-up, data, and the training run."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from megatron_epp.data.blend import BlendedSamples, split_documents
from megatron_epp.data.gpt_samples import GPTSamples, MockGPTSamples
from megatron_epp.data.tokenizers import TokenizerError
from megatron_epp.executor.context import ChunkContext
from megatron_epp.training import checkpointing, host_allocator
from megatron_epp.training.arguments import ArgumentError, parse_args, world_size_from_env
from megatron_epp.training.corpus_check import check_corpus
from megatron_epp.training.elastic import elastic_train_step
from megatron_epp.training.planning import check_memory_budget
from megatron_epp.training.faults import FaultInjection, SigtermHandler, TrainingFault
from megatron_epp.training.profiling import check_profile, startup_profile
from megatron_epp.training.gpt_step import gpt_forward_step, microbatches
from megatron_epp.training.layout_search import driver_layout_search
from megatron_epp.training.initialize import gpu_count, gpu_oversubscription, initialize, local_world_size, shutdown
from megatron_epp.training.loop import build_optimizer, megatron_step, train
from megatron_epp.training.megatron_flags import startup_notes
from megatron_epp.training.model import architecture_summary, build_model, layer_spec_summary, padded_vocab_size


def build_samples(args: argparse.Namespace, split: str):
    """Fixed-length GPT samples of ``split`` ('train' or 'valid'): mock data, an indexed dataset, or several
    blended by weight (``--data-path 0.3 A 0.7 B``: each sample drawn whole from one dataset, as megatron-core's
    ``BlendedDataset``)."""
    eod = args.eod if args.eod_mask_loss else None
    if args.mock_data:
        return MockGPTSamples(args.seq_length, args.vocab_size, seed=args.seed + (split == "valid"), eod_mask=eod)
    needed = (args.train_iters if split == "train" else args.eval_iters * (args.train_iters // (args.eval_interval or args.train_iters) + 1)) * args.global_batch_size
    sources = [split_documents(prefix, args.split, split) for prefix in args.data_blend.prefixes]
    if not sum(len(docs) for docs in sources):
        return None
    if args.data_blend.weights is None:
        return GPTSamples(sources[0], args.seq_length, seed=args.seed, num_samples=needed, eod_mask=eod)
    return BlendedSamples(lambda d, n: GPTSamples(sources[d], args.seq_length, seed=args.seed, num_samples=n, eod_mask=eod),
                          args.data_blend.weights, needed)


def _run_summary(args: argparse.Namespace, runtime, start: tuple[int, int], resume_at: int | None) -> str:
    """The start-up line: the model, the layout, the batch, and where the run starts."""
    resumed = resume_at is not None
    return (
        f"> GPT: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, "
        f"vocab {args.vocab_size}"
        + (f" (padded to {padded_vocab_size(args)})" if padded_vocab_size(args) != args.vocab_size else "")
        + f" | tp={args.tensor_model_parallel_size} pp={runtime.pp_size} "
        f"dp={runtime.dp_size} on {runtime.device.type} {'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'} | "
        + (f"global batch {args.global_batch_size} documents" if args.elastic_pp else
           f"global batch {args.global_batch_size} = {args.num_microbatches} micro-batches x {args.micro_batch_size} x dp {runtime.dp_size}")
        + (f" | resumed at iteration {start[0]}" if resumed and not args.finetune else "")
        + (f" | --finetune: weights of iteration {resume_at}, starting at iteration 0" if resumed and args.finetune else "")
        + (f" | --train-samples {args.train_samples}: {args.train_iters} iterations"
           + (f" ({args.train_samples % args.global_batch_size} samples short of a global batch not trained)"
              if args.train_samples % args.global_batch_size else "") if args.train_samples else "")
    )


def _print_startup(args: argparse.Namespace, runtime, start: tuple[int, int], resume_at: int | None, planner, budget,
                   corpus: str, notes: list[str], eval_note: str | None) -> None:
    """What the logging rank prints before the first step."""
    print(_run_summary(args, runtime, start, resume_at), flush=True)
    print(f"> architecture: {architecture_summary(args)}", flush=True)
    print(f"> layers: {layer_spec_summary(args.elastic_pp, args.sequence_parallel and args.tensor_model_parallel_size)}", flush=True)
    print(f"> host allocator: {host_allocator.describe()}", flush=True)
    for note in startup_notes(args):
        print(f"> {note}", flush=True)
    if args.elastic_pp:
        print(f"> planner: {planner}", flush=True)
        print(f"> memory budget: {budget}", flush=True)
    print(f"> data: {corpus}", flush=True)
    for note in notes:
        print(f"> {note}", flush=True)
    if eval_note:
        print(f"> warning: {eval_note}", flush=True)


def _step_for(args: argparse.Namespace, runtime, model, start: tuple[int, int], planner_state, split: str, consumed: int):
    """The step function of ``split`` from ``consumed`` samples: elastic or megatron-core's schedule (None: no data)."""
    if args.elastic_pp:
        if split == "train":  # the remaining iterations: nothing is planned past the last
            return elastic_train_step(args, runtime, model, split, consumed, planner_state, steps=args.train_iters - start[0])
        return elastic_train_step(args, runtime, model, split, consumed)
    samples = build_samples(args, split)
    if samples is None:
        return None
    batches = microbatches(samples, consumed, args.global_batch_size, args.micro_batch_size, runtime.dp_rank, runtime.dp_size, runtime.device)
    return megatron_step(args, model, gpt_forward_step, batches)


def _verified_resume(args: argparse.Namespace, resume, runtime) -> tuple[int | None, list[str], str | None]:
    """The checkpoint iteration to resume from (None: from scratch), the notes on what was loaded, and the note on a
    change of data since it was saved; :class:`~megatron_epp.training.checkpointing.CheckpointError` where none verifies."""
    if resume is None:
        if not args.load:
            return None, [], None
        return None, [f"warning: --load {args.load}: no checkpoint there yet "
                      f"({'no ' + checkpointing.TRACKER if os.path.isdir(args.load) else 'no such directory'}); "
                      "starting from scratch at iteration 0"], None
    resume_at, load_notes = checkpointing.choose_verified(args, resume, runtime)
    return resume_at, load_notes, None if args.finetune else checkpointing.data_change(args, resume_at)


def main(argv: Sequence[str] | argparse.Namespace | None = None) -> int:
    """pretrain_gpt.py: ``argv`` are its flags, or already parsed by :func:`~megatron_epp.training.arguments.parse_args`."""
    start_time = time.time()  # --exit-duration-in-mins counts from here
    planner = budget = None  # --elastic-pp's
    try:
        args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
        why = gpu_oversubscription(local_world_size(), gpu_count())
        if why:
            raise ArgumentError(why)
        corpus, eval_note = check_corpus(args)
        if args.epp_search_layout:
            print("\n".join(driver_layout_search(args, world_size_from_env())), flush=True)
            return 0
        if args.elastic_pp:
            check_profile(args)  # a profile that loads (auto on CUDA is measured or found after start-up)
            budget = check_memory_budget(args)
        resume = checkpointing.check_loadable(args) if args.load else None
        if args.load and resume is None and args.exit_on_missing_checkpoint:
            raise ArgumentError(f"--load {args.load}: no checkpoint there (--exit-on-missing-checkpoint)")
        faults = FaultInjection.from_env()
    except (ArgumentError, TokenizerError) as error:
        print(error if isinstance(error, ArgumentError) else f"pretrain_gpt.py: error: {error}", file=sys.stderr)
        return 2


    runtime = initialize(args)
    sigterm = SigtermHandler() if args.exit_signal_handler else None  # from here on a SIGTERM is acted on after the first step
    try:  # collective: every rank hashes its share of the files before megatron-core reads any
        resume_at, load_notes, data_note = _verified_resume(args, resume, runtime)
    except checkpointing.CheckpointError as error:  # the same on every rank: one line from the logging rank
        if runtime.is_logging_rank:
            print(error, file=sys.stderr, flush=True)
        shutdown()
        return 2
    if args.elastic_pp:
        try:  # every rank: the first one resolves (and on CUDA may measure) the profile, all plan on it
            planner = startup_profile(args, runtime.device)
        except ArgumentError as error:
            if runtime.is_logging_rank:
                print(error, file=sys.stderr, flush=True)
            shutdown()
            return 2
        model, config = build_model(args, runtime, context=ChunkContext())
    else:
        model, config = build_model(args, runtime)
    optimizer, scheduler = build_optimizer(args, model, config)
    start, planner_state = (0, 0), None
    if resume is not None:
        try:
            iteration, consumed, planner_state = checkpointing.load_checkpoint(args, resume_at, model, optimizer, scheduler, runtime)
        except checkpointing.CheckpointError as error:  # on the ranks that read the damaged file: the job ends
            print(error, file=sys.stderr, flush=True)
            return 2
        start = (iteration, consumed)
    if runtime.is_logging_rank:
        _print_startup(args, runtime, start, resume_at, planner, budget, corpus,
                       [*load_notes, data_note] if data_note else load_notes, eval_note)

    train_step = _step_for(args, runtime, model, start, planner_state, "train", start[1])
    try:
        train(
            args, runtime, model, optimizer, scheduler,
            train_step=train_step,
            valid_step=_step_for(args, runtime, model, start, planner_state, "valid", 0) if args.eval_interval and eval_note is None else None,
            start=start,
            step_metrics=train_step.log if args.elastic_pp else None,
            planner_state=train_step.state_dict if args.elastic_pp else None,
            start_time=start_time,
            faults=faults,
            sigterm=sigterm,
        )
    except TrainingFault as error:  # raised on every rank alike: one line from the logging rank
        if runtime.is_logging_rank:
            print(f"pretrain_gpt.py: error: {error}", file=sys.stderr, flush=True)
        return 1
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
