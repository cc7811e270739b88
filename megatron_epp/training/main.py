"""``pretrain_gpt.py``: argument parsing, set-up, data, and the training run."""

from __future__ import annotations

import os
import sys
import time

from megatron_epp.data.tokenizers import TokenizerError
from megatron_epp.training import host_allocator
from megatron_epp.checkpoint import integrity, records, reshard, store
from megatron_epp.config.parser import parse_config, world_size_from_env
from megatron_epp.config.errors import ArgumentError
from megatron_epp.training.corpus_check import check_corpus
from megatron_epp.training.faults import FaultInjection, SigtermHandler, TrainingFault, report_fault
from megatron_epp.training.layout_search import driver_layout_search
from megatron_epp.model.runtime import (
    configure_cuda_allocator, gpu_count, gpu_oversubscription, initialize, local_world_size, shutdown,
)
from megatron_epp.training.loop import build_optimizer, train
from megatron_epp.config.megatron_flags import startup_notes
from megatron_epp.model.gpt import architecture_summary, build_model, layer_spec_summary, padded_vocab_size
from megatron_epp.training.step import StepMode, step_mode
from megatron_epp.training.torch_trace import TorchTrace, startup_note
from megatron_epp.config.fields import TrainingConfig


def _run_summary(cfg: TrainingConfig, runtime, steps: StepMode, start: tuple[int, int],
                 resume_at: int | None) -> str:
    """The start-up line: the model, the layout, the batch, and where the run starts."""
    resumed = resume_at is not None
    return (
        f"> GPT: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, {cfg.model.num_attention_heads} heads, "
        f"vocab {cfg.model.vocab_size}"
        + (f" (padded to {padded_vocab_size(cfg)})" if padded_vocab_size(cfg) != cfg.model.vocab_size else "")
        + f" | tp={runtime.dims.tp} " + (f"cp={runtime.dims.cp} " if runtime.dims.cp > 1 else "") + f"pp={runtime.dims.pp} "
        f"dp={runtime.dims.dp} on {runtime.device.type} {cfg.model.precision} | "
        + steps.batch_text(runtime)
        + (f" | resumed at iteration {start[0]}" if resumed and not cfg.checkpoint.finetune else "")
        + (f" | --finetune: weights of iteration {resume_at}, starting at iteration 0" if resumed and cfg.checkpoint.finetune else "")
        + (f" | --train-samples {cfg.training.train_samples}: {cfg.training.train_iters} iterations"
           + (f" ({cfg.training.train_samples % cfg.training.global_batch_size} samples short of a global batch not trained)"
              if cfg.training.train_samples % cfg.training.global_batch_size else "") if cfg.training.train_samples else "")
    )


def _print_startup(cfg: TrainingConfig, runtime, steps: StepMode, start: tuple[int, int],
                   resume_at: int | None, corpus: str, notes: list[str], eval_note: str | None) -> None:
    """What the logging rank prints before the first step."""
    print(_run_summary(cfg, runtime, steps, start, resume_at), flush=True)
    print(f"> architecture: {architecture_summary(cfg)}", flush=True)
    print(f"> layers: {layer_spec_summary(cfg.epp.enabled, runtime.dims.sequence_parallel and runtime.dims.tp)}", flush=True)
    print(f"> host allocator: {host_allocator.describe()}", flush=True)
    for note in startup_notes(cfg):
        print(f"> {note}", flush=True)
    for line in steps.startup_lines():
        print(f"> {line}", flush=True)
    print(f"> data: {corpus}", flush=True)
    for note in notes:
        print(f"> {note}", flush=True)
    if eval_note:
        print(f"> warning: {eval_note}", flush=True)


def _verified_resume(cfg: TrainingConfig, resume, runtime) -> tuple[int | None, list[str], str | None]:
    """The checkpoint iteration to resume from (None: from scratch), the notes on what was loaded, and the note on a
    change of data since it was saved; :class:`~megatron_epp.checkpoint.records.CheckpointError` where none verifies."""
    if resume is None:
        if not cfg.checkpoint.load:
            return None, [], None
        return None, [f"warning: --load {cfg.checkpoint.load}: no checkpoint there yet "
                      f"({'no ' + records.TRACKER if os.path.isdir(cfg.checkpoint.load) else 'no such directory'}); "
                      "starting from scratch at iteration 0"], None
    resume_at, load_notes = integrity.choose_verified(cfg, resume, runtime)
    return resume_at, load_notes + reshard.reshard_notes(cfg, resume_at), None if cfg.checkpoint.finetune else records.data_change(cfg, resume_at)


def main(cfg: TrainingConfig) -> int:
    """pretrain_gpt.py's run of the configuration its flags make (:func:`~megatron_epp.config.parser.parse_config`;
    ``pretrain_gpt.run`` parses them)."""
    start_time = time.time()  # --exit-duration-in-mins counts from here
    allocator_note = configure_cuda_allocator()  # before anything touches CUDA
    try:
        why = gpu_oversubscription(local_world_size(), gpu_count())
        if why:
            raise ArgumentError(why)
        corpus, eval_note = check_corpus(cfg)
        if cfg.epp.search_layout:
            print("\n".join(driver_layout_search(cfg, world_size_from_env())), flush=True)
            return 0
        steps = step_mode(cfg)
        resume = integrity.check_loadable(cfg) if cfg.checkpoint.load else None
        if cfg.checkpoint.load and resume is None and cfg.checkpoint.exit_on_missing_checkpoint:
            raise ArgumentError(f"--load {cfg.checkpoint.load}: no checkpoint there (--exit-on-missing-checkpoint)")
        faults = FaultInjection.from_env()
    except (ArgumentError, TokenizerError) as error:
        print(error if isinstance(error, ArgumentError) else f"pretrain_gpt.py: error: {error}", file=sys.stderr)
        return 2


    runtime = initialize(cfg)
    sigterm = SigtermHandler() if cfg.training.exit_signal_handler else None  # from here on a SIGTERM is acted on after the first step
    try:  # collective: every rank hashes its share of the files before megatron-core reads any
        resume_at, load_notes, data_note = _verified_resume(cfg, resume, runtime)
    except records.CheckpointError as error:  # the same on every rank: one line from the logging rank
        if runtime.is_logging_rank:
            print(error, file=sys.stderr, flush=True)
        shutdown()
        return 2
    try:  # every rank (--elastic-pp: the planner's profile, resolved by the first rank)
        steps.start(runtime)
    except ArgumentError as error:
        if runtime.is_logging_rank:
            print(error, file=sys.stderr, flush=True)
        shutdown()
        return 2
    model, config = build_model(cfg, runtime, context=steps.model_context())
    optimizer, scheduler = build_optimizer(cfg, model, config)
    start, planner_state = (0, 0), None
    if resume is not None:
        try:
            iteration, consumed, planner_state = store.load_checkpoint(cfg, resume_at, model, optimizer, scheduler, runtime)
        except records.CheckpointError as error:  # on the ranks that read the damaged file: the job ends
            print(error, file=sys.stderr, flush=True)
            return 2
        start = (iteration, consumed)
    if runtime.is_logging_rank:
        _print_startup(cfg, runtime, steps, start, resume_at, corpus,
                       [*filter(None, [allocator_note]), *load_notes, *filter(None, [data_note, startup_note(cfg, runtime.device, start[0])])],
                       eval_note)

    try:
        train(
            cfg, runtime, model, optimizer, scheduler,
            # the remaining iterations: nothing is planned past the last
            train_step=steps.build(runtime, model, "train", start[1], planner_state, steps=cfg.training.train_iters - start[0],
                                   faults=faults),
            valid_step=steps.build(runtime, model, "valid", 0) if cfg.logging.eval_interval and eval_note is None else None,
            start=start,
            start_time=start_time,
            faults=faults,
            sigterm=sigterm,
            trace=TorchTrace(cfg, runtime, start[0]),
        )
    except TrainingFault as error:  # raised on every rank alike: one line from the logging rank, written before any exits
        report_fault(error, runtime.is_logging_rank)
        return 1
    shutdown()
    return 0


if __name__ == "__main__":  # python -m megatron_epp.training.main FLAGS: pretrain_gpt.py FLAGS
    try:
        config = parse_config()
    except ArgumentError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(config))
