"""The training step: one interface (:class:`TrainStep`) that the loop runs, and the two ways of making it, picked once
from the flags (:func:`step_mode`): megatron-core's own schedule over fixed-length samples (:class:`StockSteps`, whose
steps are :class:`StockTrainStep`) or ``--elastic-pp``'s planned schedule over whole documents (:class:`ElasticSteps`,
whose steps are :class:`~megatron_epp.training.elastic.ElasticTrainStep`)."""

from __future__ import annotations

import os
from typing import Any, Iterator, Protocol

import numpy as np
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_epp.data.blend import BlendedSamples, split_documents
from megatron_epp.data.gpt_samples import GPTSamples, MockGPTSamples
from megatron_epp.executor.context import ChunkContext
from megatron_epp.training.elastic import elastic_train_step
from megatron_epp.training.faults import FaultInjection
from megatron_epp.training.gpt_step import gpt_forward_step, microbatches
from megatron_epp.model.runtime import Runtime, local_world_size
from megatron_epp.training.metrics import ElasticMetrics
from megatron_epp.training.planning import check_memory_budget, online_planner, startup_host_link
from megatron_epp.measure.profile_resolution import (
    Resolved, configure_kernel_cache, describe, loaded_profile, profile_before_startup, startup_profile,
)
from megatron_epp.config.fields import TrainingConfig


class TrainStep(Protocol):
    """One global batch of a split, step after step."""

    def __call__(self, forward_only: bool) -> tuple[list[dict[str, torch.Tensor]], np.ndarray]:
        """``(last stage's per-micro-batch losses, the global batch's causal sequence lengths)``: every sample of
        ``--seq-length`` tokens on the stock path (attention spans the sample), every document's trained tokens with
        ``--elastic-pp``."""

    def log(self, iteration: int) -> ElasticMetrics | None:
        """The last step's own metrics for the log line and record of ``iteration`` (None: none beyond the loop's)."""

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of this step besides the model and optimizer (None: nothing)."""


class StockTrainStep:
    """One global batch through Megatron-Core's own schedule (1F1B for pp > 1)."""

    def __init__(self, cfg: TrainingConfig, model, forward_step_func, data_iterator: Iterator) -> None:
        self.cfg, self.model, self.forward_step_func, self.data_iterator = cfg, model, forward_step_func, data_iterator
        self.forward_backward = get_forward_backward_func()

    def __call__(self, forward_only: bool) -> tuple[list[dict[str, torch.Tensor]], np.ndarray]:
        cfg = self.cfg
        losses = self.forward_backward(
            forward_step_func=self.forward_step_func,
            data_iterator=self.data_iterator,
            model=[self.model],
            num_microbatches=cfg.training.num_microbatches,
            seq_length=cfg.model.seq_length,
            micro_batch_size=cfg.training.micro_batch_size,
            forward_only=forward_only,
        )
        return losses, np.full(cfg.training.global_batch_size, cfg.model.seq_length, dtype=np.int64)

    def log(self, iteration: int) -> None:
        return None

    def state_dict(self) -> None:
        return None


def build_samples(cfg: TrainingConfig, split: str):
    """Fixed-length GPT samples of ``split`` ('train' or 'valid'): mock data, an indexed dataset, or several
    blended by weight (``--data-path 0.3 A 0.7 B``: each sample drawn whole from one dataset, as megatron-core's
    ``BlendedDataset``)."""
    eod = cfg.data.eod if cfg.data.eod_mask_loss else None
    if cfg.data.mock_data:
        return MockGPTSamples(cfg.model.seq_length, cfg.model.vocab_size, seed=cfg.training.seed + (split == "valid"), eod_mask=eod)
    needed = (cfg.training.train_iters if split == "train" else cfg.logging.eval_iters * (cfg.training.train_iters // (cfg.logging.eval_interval or cfg.training.train_iters) + 1)) * cfg.training.global_batch_size
    sources = [split_documents(prefix, cfg.data.split, split) for prefix in cfg.data.data_blend.prefixes]
    if not sum(len(docs) for docs in sources):
        return None
    if cfg.data.data_blend.weights is None:
        return GPTSamples(sources[0], cfg.model.seq_length, seed=cfg.training.seed, num_samples=needed, eod_mask=eod)
    return BlendedSamples(lambda d, n: GPTSamples(sources[d], cfg.model.seq_length, seed=cfg.training.seed, num_samples=n, eod_mask=eod),
                          cfg.data.data_blend.weights, needed)


class StockSteps:
    """Megatron-core's schedule over fixed-length samples: nothing to check or resolve before the model."""

    def __init__(self, cfg: TrainingConfig) -> None:
        self.cfg = cfg

    def start(self, runtime: Runtime) -> None:
        """After the process groups are up, before the model is built: nothing here."""

    def model_context(self) -> ChunkContext | None:
        return None

    def batch_text(self, runtime: Runtime) -> str:
        cfg = self.cfg
        return (f"global batch {cfg.training.global_batch_size} = {cfg.training.num_microbatches} micro-batches x {cfg.training.micro_batch_size} "
                f"x dp {runtime.dims.dp}")

    def startup_lines(self) -> list[str]:
        return []

    def build(self, runtime: Runtime, model, split: str, consumed: int, planner_state: dict[str, Any] | None = None,
              steps: int | None = None, faults: FaultInjection = FaultInjection()) -> StockTrainStep | None:
        """The step of ``split`` from ``consumed`` samples (None: no data); ``planner_state``, ``steps`` and ``faults``
        are the elastic step's (a stock step has no state, an endless batch stream and no out-of-memory recovery)."""
        samples = build_samples(self.cfg, split)
        if samples is None:
            return None
        batches = microbatches(samples, consumed, self.cfg.training.global_batch_size, self.cfg.training.micro_batch_size,
                               runtime.dp_rank, runtime.dims.dp, runtime.device)
        return StockTrainStep(self.cfg, model, gpt_forward_step, batches)


def planning_line(between_steps: bool, local_ranks: int, host_cores: int, rank_cores: int) -> str:
    """The start-up line on when each batch is planned: ``between_steps`` (``--epp-plan-between-steps``), or in a
    background thread while the step before it runs, said to share a core with training where this rank has fewer
    than 2 cores of its own: the ``rank_cores`` of its CPU affinity where that is less than the host's ``host_cores``
    (bound), else the host's cores over its ``local_ranks``; the planner's time then lengthens the planning rank's
    steps (and, through their collectives, its peers')."""
    if between_steps:
        return ("planning: each global batch between steps (--epp-plan-between-steps), by the first rank of each "
                "model replica: its time is exposed")
    line = ("planning: each global batch in a background thread of the first rank of each model replica, while the "
            "step before it runs")
    bound = rank_cores < host_cores
    own = rank_cores if bound else host_cores / local_ranks
    if own < 2:
        why = (f"its CPU affinity: {rank_cores} of the host's {host_cores}" if bound
               else f"{local_ranks} ranks on the host's {host_cores}")
        line += (f"; this rank has {own:g} core{'' if own == 1 else 's'} of its own ({why}), so that thread shares a "
                 "core with training (--epp-plan-between-steps keeps it out of the steps)")
    return line


class ElasticSteps:
    """``--elastic-pp``: made only after a profile that loads and a memory budget that can plan (both checked here,
    before any work); the profile is resolved by :meth:`start`, on every rank."""

    def __init__(self, cfg: TrainingConfig) -> None:
        self.cfg = cfg
        # the run's one resolution of its profile where nothing is measured (None: auto on CUDA, after start-up)
        self.loaded = loaded_profile(cfg)
        self.checked = profile_before_startup(cfg, self.loaded)  # what the budget is checked on before start-up
        # the run's one planner: the budget check's, training's and validation's (built again at start-up on a
        # profile other than the one checked here)
        self.planner = online_planner(cfg, self.checked)
        self.budget = check_memory_budget(cfg, self.planner)
        self.profile: Resolved | None = None
        self.kernel_cache = ""  # flash-attn-4's compile cache (CUDA), said at start-up
        self.host_line = ""  # --epp-offload: the host link measured at start-up, said at start-up

    def start(self, runtime: Runtime) -> None:
        """Every rank: the profile loaded before start-up, or (``auto`` on CUDA) the one the first rank measures or
        finds in the cache now and sends to all; the memory budget is checked again on it where it is not the one
        checked before start-up (a measured profile's memory may exceed the analytic count);
        :class:`~megatron_epp.config.errors.ArgumentError` where either cannot serve. ``--epp-offload``: the copy
        bandwidth is measured here, on every rank at once, and the planner is built again on it."""
        if runtime.device.type == "cuda":  # before anything imports flash-attn-4 (the profile's kernel decision)
            self.kernel_cache = configure_kernel_cache(self.cfg)
        self.profile = self.loaded or startup_profile(self.cfg, runtime.device)
        host = startup_host_link(self.cfg, runtime.device, local_world_size())
        if host is not None:
            self.host_line = host[1]
        if self.profile.profile != self.checked or host is not None:  # a profile measured on this GPU (or found in
            # the cache: its memory counts), or the host link measured now
            self.planner = online_planner(self.cfg, self.profile.profile, host[0] if host is not None else None)
            self.budget = check_memory_budget(self.cfg, self.planner)

    def model_context(self) -> ChunkContext:
        return ChunkContext()

    def batch_text(self, runtime: Runtime) -> str:
        return f"global batch {self.cfg.training.global_batch_size} documents"

    def startup_lines(self) -> list[str]:
        planner = describe(self.cfg, self.profile) if self.profile is not None else "not resolved yet"
        return [f"planner: {planner}", f"memory budget: {self.budget}",
                planning_line(self.cfg.epp.plan_between_steps, local_world_size(), os.cpu_count() or 1,
                              len(os.sched_getaffinity(0))), *([f"flash-attn-4: {self.kernel_cache}"] if self.kernel_cache else []),
                *([self.host_line] if self.host_line else [])]

    def build(self, runtime: Runtime, model, split: str, consumed: int, planner_state: dict[str, Any] | None = None,
              steps: int | None = None, faults: FaultInjection = FaultInjection()) -> TrainStep | None:
        """The step of ``split`` from ``consumed`` samples, its planner continuing from ``planner_state``, for
        ``steps`` steps (None: no end); None where the split is empty. ``faults``: the test-only fault injection
        (an out-of-memory error planted in a step)."""
        if self.profile is None:
            raise RuntimeError("ElasticSteps.build before start(): the run's profile is resolved at start-up")
        return elastic_train_step(self.cfg, self.planner, runtime, model, split, consumed, planner_state, steps, faults)


StepMode = StockSteps | ElasticSteps


def step_mode(cfg: TrainingConfig) -> StepMode:
    """The run's way of stepping; :class:`~megatron_epp.config.parser.ArgumentError` (``--elastic-pp``) where its
    profile or memory budget cannot serve."""
    return ElasticSteps(cfg) if cfg.epp.enabled else StockSteps(cfg)
