"""The training driver: optimizer, LR schedule, train/eval steps, logging, checkpoints."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import replace
from typing import Any

import torch
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_epp.checkpoint import store
from megatron_epp.training.faults import ExitConditions, FaultInjection, SigtermHandler, check_finite
from megatron_epp.training.gpt_step import reduce_losses
from megatron_epp.model.runtime import Runtime
from megatron_epp.training.metrics import StepMetrics, interval_average
from megatron_epp.model.gpt import model_shape, params_dtype
from megatron_epp.training.step import TrainStep
from megatron_epp.training.torch_trace import TorchTrace
from megatron_epp.config.fields import TrainingConfig


def build_optimizer(cfg: TrainingConfig, model, config) -> tuple[Any, OptimizerParamScheduler]:
    """Megatron's optimizer (``--optimizer``, grad clipping; under ``--fp16`` its loss scaler, dynamic unless
    ``--loss-scale``, which the schedules apply to the last stage's loss through ``config.grad_scale_func``, as
    Megatron-LM) and its sample-based LR/WD scheduler."""
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=cfg.optim.optimizer,
            lr=cfg.optim.lr,
            min_lr=cfg.optim.min_lr,
            decoupled_lr=cfg.optim.decoupled_lr,
            decoupled_min_lr=cfg.optim.decoupled_min_lr,
            weight_decay=cfg.optim.weight_decay,
            adam_beta1=cfg.optim.adam_beta1,
            adam_beta2=cfg.optim.adam_beta2,
            adam_eps=cfg.optim.adam_eps,
            sgd_momentum=cfg.optim.sgd_momentum,
            clip_grad=cfg.optim.clip_grad,
            bf16=cfg.model.bf16,
            fp16=cfg.model.fp16,
            loss_scale=cfg.optim.loss_scale,
            initial_loss_scale=cfg.optim.initial_loss_scale,
            min_loss_scale=cfg.optim.min_loss_scale,
            loss_scale_window=cfg.optim.loss_scale_window,
            hysteresis=cfg.optim.hysteresis,
            params_dtype=params_dtype(cfg),
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        ),
        [model],
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    if cfg.model.fp16:
        config.grad_scale_func = optimizer.scale_loss
    return optimizer, build_scheduler(cfg, optimizer)


def build_scheduler(cfg: TrainingConfig, optimizer) -> OptimizerParamScheduler:
    """megatron-core's LR/WD scheduler over ``optimizer``'s parameter groups, counting samples as Megatron-LM's:
    a warm-up (``--lr-warmup-iters`` x the global batch, ``--lr-warmup-samples``, or ``--lr-warmup-fraction`` of the
    decay) from ``--lr-warmup-init`` to ``--lr``, then ``--lr-decay-style`` down to ``--min-lr`` (``WSD``: annealed over
    its last ``--lr-wsd-decay-iters`` x the global batch or ``--lr-wsd-decay-samples``)."""
    gbs = cfg.training.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=cfg.optim.lr_warmup_init,
        max_lr=cfg.optim.lr,
        min_lr=cfg.optim.min_lr,
        lr_warmup_steps=cfg.optim.lr_warmup_samples,  # the scheduler counts samples, as Megatron-LM's
        lr_decay_steps=cfg.optim.lr_decay_samples,
        lr_decay_style=cfg.optim.lr_decay_style,
        start_wd=cfg.optim.weight_decay,
        end_wd=cfg.optim.weight_decay,
        wd_incr_steps=cfg.training.train_samples or cfg.training.train_iters * gbs,
        wd_incr_style="constant",
        wsd_decay_steps=cfg.optim.lr_wsd_decay_samples_total,
        lr_wsd_decay_style=cfg.optim.lr_wsd_decay_style,
    )


class Logger:
    """Megatron-style iteration lines on the logging rank, the ``--epp-metrics`` JSON lines beside
    them, and each record's scalars to TensorBoard (``--tensorboard-dir``) and wandb (``--wandb-project``)."""

    def __init__(self, cfg: TrainingConfig, runtime: Runtime) -> None:
        self.enabled = runtime.is_logging_rank
        self.writer = None
        self.metrics = None
        self.wandb = None
        if self.enabled and cfg.logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # here, not at the top: 0.65 s of every start otherwise

            self.writer = SummaryWriter(cfg.logging.tensorboard_dir)
        if self.enabled and cfg.logging.wandb_project:
            import wandb  # optional: checked by validate_args

            wandb.init(project=cfg.logging.wandb_project, name=cfg.logging.wandb_exp_name, dir=cfg.logging.wandb_save_dir,
                       config=cfg.flat())
            self.wandb = wandb
        if self.enabled and cfg.logging.epp_metrics:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.logging.epp_metrics)), exist_ok=True)
            self.metrics = open(cfg.logging.epp_metrics, "a", buffering=1)

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def record(self, m: StepMetrics, line: str | None = None) -> None:
        """Print ``line`` (default: the record's), append the record to the metrics file, and send its scalars."""
        self.print(m.line() if line is None else line)
        if self.metrics:
            self.metrics.write(m.to_json() + "\n")
        scalars = m.scalars() if self.writer or self.wandb else {}
        if self.writer:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, m.iteration)
        if self.wandb:
            self.wandb.log(scalars, step=m.iteration)

    def close(self) -> None:
        if self.writer:
            self.writer.close()
        if self.wandb:
            self.wandb.finish()
        if self.metrics:
            self.metrics.close()


def _broadcast_from_last_stage(value: float | None, runtime: Runtime) -> float:
    """Give every rank the last stage's value (for logging decisions and grad-norm-free ranks)."""
    t = torch.tensor([value if value is not None else 0.0], dtype=torch.float64, device=runtime.device)
    torch.distributed.broadcast(t, src=runtime.world_size - 1)
    return float(t.item())


def _train_iteration(cfg: TrainingConfig, runtime: Runtime, model, optimizer, scheduler: OptimizerParamScheduler,
                     train_step: TrainStep, faults: FaultInjection, logger: Logger, iteration: int):
    """Forward-backward and the optimizer update of ``iteration`` (counted from 1); return its losses, sequence
    lengths and gradient norm. A skipped update is fp16's overflow (said), else an error."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses, seq_lengths = train_step(False)
    faults.poison_loss(iteration, losses)
    faults.poison_grads(iteration, runtime.rank, model.buffers)
    if cfg.training.empty_unused_memory_level >= 1 and runtime.device.type == "cuda":
        torch.cuda.empty_cache()
    if cfg.training.check_for_nan_in_loss_and_grad:
        local_loss = torch.stack([d["lm loss"] for d in losses]) if losses else None
        # under --fp16 an overflowing scaled gradient is the loss scaler's to handle (a skipped step)
        check_finite(iteration, local_loss, [] if cfg.model.fp16 else model.buffers, runtime.rank, runtime.device)
    scale = optimizer.get_loss_scale().item() if cfg.model.fp16 else None
    update_ok, grad_norm, _ = optimizer.step()
    if cfg.training.empty_unused_memory_level >= 2 and runtime.device.type == "cuda":
        torch.cuda.empty_cache()
    if update_ok:
        scheduler.step(increment=cfg.training.global_batch_size)  # as Megatron-LM: a skipped step does not advance it
    elif cfg.model.fp16:
        logger.print(f" iteration {iteration}: fp16 gradients overflowed at loss scale {scale:g}: update "
                     f"skipped, loss scale now {optimizer.get_loss_scale().item():g}")
    else:
        raise FloatingPointError(f"optimizer step skipped at iteration {iteration}")
    return losses, seq_lengths, grad_norm


def _collect_and_evaluate(cfg: TrainingConfig, runtime: Runtime, valid_step: TrainStep | None, dp_group,
                          logger: Logger, iteration: int) -> None:
    """After ``iteration``: ``--manual-gc``'s collection at its interval, and the evaluation at ``--eval-interval``
    (with a collection before and after it under ``--manual-gc``)."""
    if cfg.training.manual_gc and cfg.training.manual_gc_interval and iteration % cfg.training.manual_gc_interval == 0:
        gc.collect()
    if valid_step and cfg.logging.eval_interval and iteration % cfg.logging.eval_interval == 0:
        if cfg.training.manual_gc and cfg.training.manual_gc_eval:
            gc.collect()
        logger.record(StepMetrics(iteration, evaluate(cfg, runtime, valid_step, dp_group), kind="valid"))
        if cfg.training.manual_gc and cfg.training.manual_gc_eval:
            gc.collect()


def train(
    cfg: TrainingConfig,
    runtime: Runtime,
    model,
    optimizer,
    scheduler: OptimizerParamScheduler,
    train_step: TrainStep,
    valid_step: TrainStep | None,
    start: tuple[int, int] = (0, 0),
    start_time: float | None = None,
    faults: FaultInjection = FaultInjection(),
    sigterm: SigtermHandler | None = None,
    trace: TorchTrace = TorchTrace(),
) -> list[float]:
    """Run iterations ``start[0]+1 .. --train-iters``, or until an exit condition (``--exit-*``) holds
    after one, saving then; return the losses seen by every rank. A NaN/Inf under
    ``--check-for-nan-in-loss-and-grad`` raises :class:`TrainingFault` on every rank. ``train_step``'s state (the
    planner's calibration under ``--elastic-pp``) is saved in every checkpoint; ``sigterm``: the
    ``--exit-signal-handler`` handler if already installed; ``trace``: ``--profile``'s, stepped before each iteration."""
    iteration, consumed = start
    logger = Logger(cfg, runtime)
    exits = ExitConditions(cfg.training, runtime.device, time.time() if start_time is None else start_time, sigterm)
    dp_group = runtime.pg_collection.dp_cp  # DP x CP: each context-parallel rank's loss is of its own tokens
    history: list[float] = []
    interval: list[StepMetrics] = []  # the iterations since the last log line
    shape = model_shape(cfg) if cfg.logging.log_throughput else None
    saved_at = None
    if cfg.training.manual_gc:  # as Megatron-LM: collect now, then only when every rank does (no collection pausing one rank)
        gc.disable()
        gc.collect()

    def save() -> None:
        nonlocal saved_at
        path = store.save_checkpoint(
            cfg, model, optimizer, scheduler, runtime, iteration, consumed,
            before_commit=lambda: faults.crash_in_save(iteration, runtime.rank),
            planner_state=train_step.state_dict(),
        )
        saved_at = iteration
        logger.print(f" saved checkpoint at iteration {iteration} to {path}")

    try:
        while iteration < cfg.training.train_iters:
            faults.hang(iteration + 1, runtime.rank)
            trace.step(iteration + 1)
            t0 = time.perf_counter()
            losses, seq_lengths, grad_norm = _train_iteration(cfg, runtime, model, optimizer, scheduler, train_step, faults,
                                                              logger, iteration + 1)
            iteration += 1
            consumed += cfg.training.global_batch_size
            loss = _broadcast_from_last_stage(reduce_losses(losses, dp_group), runtime)
            ms = (time.perf_counter() - t0) * 1000
            history.append(loss)
            interval.append(StepMetrics(
                iteration, loss, iter_ms=ms, tokens=int(seq_lengths.sum()),
                tflops_per_gpu=shape.training_flops(seq_lengths) / (ms / 1000) / runtime.world_size / 1e12 if shape else None,
            ))
            if iteration % cfg.logging.log_interval == 0:
                logged = replace(interval[-1], train_iters=cfg.training.train_iters, consumed_samples=consumed,
                                 lr=scheduler.get_lr(optimizer.param_groups[0]), grad_norm=float(grad_norm or 0.0),
                                 elastic=train_step.log(iteration))
                logger.record(logged, line=interval_average(logged, interval).line())  # the line as Megatron-LM's
                interval.clear()
            _collect_and_evaluate(cfg, runtime, valid_step, dp_group, logger, iteration)
            if cfg.checkpoint.save and cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0:
                save()
            reason = exits.reason(iteration)
            if reason:
                logger.print(f" exiting after iteration {iteration}: {reason}")
                break
        if cfg.checkpoint.save and saved_at != iteration:
            save()
    finally:
        trace.close()
        if cfg.training.manual_gc:
            gc.enable()
        exits.close()
        logger.close()
    return history


def evaluate(cfg: TrainingConfig, runtime: Runtime, valid_step: TrainStep, dp_group) -> float:
    """Mean token loss over ``--eval-iters`` forward-only global batches."""
    totals = []
    with torch.no_grad():
        for _ in range(cfg.logging.eval_iters):
            losses, _ = valid_step(True)
            totals.append(_broadcast_from_last_stage(reduce_losses(losses, dp_group), runtime))
    return sum(totals) / len(totals)
