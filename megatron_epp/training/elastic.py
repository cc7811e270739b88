"""``--elastic-pp``: whole documents per global batch, a new plan every step, the elastic schedule."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.utils import get_model_config

from megatron_epp.cost.model import CostModel
from megatron_epp.cost.profiles import GIB, StageOverhead, megatron_model_state
from megatron_epp.data.blend import blended_documents
from megatron_epp.data.mock_documents import MockDocuments, lognormal_lengths
from megatron_epp.data.sequence_sampler import SequenceSampler
from megatron_epp.executor.batches import elastic_gpt_forward_step, prepare_step
from megatron_epp.executor.context import ChunkContext, token_multiple
from megatron_epp.executor.memory_tracker import ActivationMemoryTracker
from megatron_epp.executor.schedule import forward_backward_elastic
from megatron_epp.plan import Plan, PlanInfeasible
from megatron_epp.planner.builders import plan_batch
from megatron_epp.planner.calibration import (
    ONLINE_PRIOR_WEIGHT, MemoryCheck, StepFit, activation_bytes, fit_memory_factor, fit_step_model, repredict, with_memory_factor,
)
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.simulator import simulate
from megatron_epp.simulator.timeline import draw_timeline
from megatron_epp.training.arguments import CALIBRATE_FIRST_STEP, ArgumentError
from megatron_epp.training.initialize import Runtime
from megatron_epp.training.metrics import ElasticMetrics
from megatron_epp.training.profiling import planner_profile
from megatron_epp.training.model import model_shape


class PlanBuilder:
    """The ``--epp-plan`` builder on the planner's cost model for this model and pipeline, calibrated to
    this machine on the measured steps (``--epp-calibrate-interval``): their times (speed factor and per-chunk
    overhead) and their per-stage activation peaks (the activation memory factor)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.config = PlannerConfig.from_args(args, args.seq_length)
        shape = model_shape(args)
        profile = planner_profile(args)  # at the run's TP size; the start-up line says which
        shape = dataclasses.replace(shape, name=profile.model.name)
        memory = dataclasses.replace(profile.memory, **megatron_model_state(shape.dtype, args.use_distributed_optimizer))
        self.cost_model = CostModel(
            dataclasses.replace(profile, model=shape, memory=memory, sequence_parallel=args.sequence_parallel),
            args.pipeline_model_parallel_size, dp=args.data_parallel_size,
        )
        self.budget_bytes = self.config.memory_gb * GIB
        self.raw_model = self.cost_model  # the profile's memory coefficients (memory factor 1), for the raw prediction
        self.calibrate_interval = args.epp_calibrate_interval
        self.measured: deque[tuple[Plan, float]] = deque(maxlen=max(self.calibrate_interval, CALIBRATE_FIRST_STEP - 1))
        self.steps_observed = 0  # training steps of the run (a resumed run's count on from its checkpoint)
        self.warmed_up = False  # the first step of this process has been observed (never fitted on)
        # the cost model the step after the last observed one was planned on (plans are made one step ahead,
        # before the fit that follows the step being run; after a change of the memory factor it is planned again,
        # on the new model)
        self.next_step_model = self.cost_model
        # the activation memory factor of cost_model and of next_step_model, and the largest measured / raw-predicted
        # activation peak of the steps observed (the warm-up's too: its peak is real)
        self.memory_factor = self.next_step_memory_factor = 1.0
        self.memory_ratio = 0.0
        self.memory_check: MemoryCheck | None = None  # the last observed step's, when its peaks were measured
        self.memory_note: str | None = None  # its line for the log: a peak over the budget, or a new memory factor

    def __call__(self, lengths: list[int], cost_model: CostModel | None = None) -> Plan:
        """The plan of ``lengths`` on ``cost_model`` (default: the current one)."""
        return plan_batch(lengths, cost_model or self.cost_model, self.config)

    def observe(self, plan: Plan, measured_ms: float, measured_activation_bytes: list[float] | None = None) -> StepFit | None:
        """Take a training step's plan, measured span (``forward_backward_elastic`` on the last stage, the span
        the simulator predicts) and, when measured, per-stage activation peaks (:attr:`memory_check`). After
        step ``CALIBRATE_FIRST_STEP`` and every ``--epp-calibrate-interval`` steps after it, refit the speed
        factor and the per-chunk stage overhead on the last steps kept (the first step of each process, a
        warm-up, never is) and the activation memory factor on every step's peaks (:func:`fit_memory_factor`),
        and plan the following steps on the result; a step whose peak (model states + activations) exceeds
        the budget refits the memory factor at once. Returns the time fit when one was made. A change of the
        memory factor makes :attr:`next_step_model` the new model: the step after this one, planned before,
        is planned again on it (the driver compares models). :attr:`memory_note`: the line to log about it."""
        self.steps_observed += 1
        self.memory_check = check = None if measured_activation_bytes is None else MemoryCheck(
            self.steps_observed, activation_bytes(plan, self.raw_model), np.asarray(measured_activation_bytes, dtype=float),
            self.raw_model.model_state_bytes(), self.budget_bytes)
        self.memory_note = None
        if not self.calibrate_interval:
            if check is not None and check.over:
                self.memory_note = f"{check.overshoot_line()}; not recalibrated (--epp-calibrate-interval 0)"
            return None
        before = self.memory_factor
        self.next_step_model, self.next_step_memory_factor = self.cost_model, before
        if check is not None:
            self.memory_ratio = max(self.memory_ratio, check.ratio)
        since_first = self.steps_observed - CALIBRATE_FIRST_STEP
        scheduled = self.warmed_up and since_first >= 0 and since_first % self.calibrate_interval == 0
        if self.warmed_up:
            self.measured.append((plan, measured_ms))
        self.warmed_up = True
        model, fit = self.cost_model, None
        if scheduled:
            plans, times = zip(*self.measured)
            fit = fit_step_model(plans, times, model, prior_weight=ONLINE_PRIOR_WEIGHT)
            model = fit.apply(model)
        over = check is not None and check.over
        factor = fit_memory_factor([self.memory_ratio]) if scheduled or over else before
        if over:
            self.memory_note = f"{check.overshoot_line()}; recalibrating: activation memory factor {before:.3f} -> {factor:.3f}"
        elif factor != before:
            self.memory_note = (f" memory model calibrated on this machine's measured peaks: activation memory factor "
                                f"{before:.3f} -> {factor:.3f} (the largest measured / predicted activation peak so far)")
        if factor != before:
            model = with_memory_factor(model, self.raw_model.profile.memory, factor)
        # one reference swap: a plan being made in the planning thread keeps the model it started on
        self.cost_model, self.memory_factor = model, factor
        if factor != before:  # the next step, planned on the old factor, is planned again on this model
            self.next_step_model, self.next_step_memory_factor = model, factor
        return fit

    def state_dict(self) -> dict[str, Any]:
        """The calibration, for a checkpoint: what a run resumed from it needs to plan and refit as this run
        would (same batches and the same measured times and peaks given): the current and the next step's cost
        model (as ``(s, o forward, o backward)`` and the activation memory factor), the step count, the steps
        the next time fit uses and the largest measured / predicted activation peak seen."""
        return {"steps_observed": self.steps_observed, "calibration": _calibration(self.cost_model),
                "next_step_calibration": _calibration(self.next_step_model),
                "measured": [(plan.to_json(), ms) for plan, ms in self.measured],
                "memory": {"factor": self.memory_factor, "next_step_factor": self.next_step_memory_factor,
                           "ratio": self.memory_ratio}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s calibration (a checkpoint's; one saved before the memory factor
        existed has none: factor 1); with ``--epp-calibrate-interval 0`` keep the profile as given (and count
        the steps on)."""
        self.steps_observed = state["steps_observed"]
        if not self.calibrate_interval:
            return
        memory = state.get("memory", {"factor": 1.0, "next_step_factor": 1.0, "ratio": 0.0})
        self.cost_model, self.memory_factor = self._calibrated(state["calibration"], memory["factor"]), memory["factor"]
        self.next_step_model = self._calibrated(state["next_step_calibration"], memory["next_step_factor"])
        self.next_step_memory_factor, self.memory_ratio = memory["next_step_factor"], memory["ratio"]
        self.measured.clear()
        self.measured.extend((Plan.from_json(text), ms) for text, ms in state["measured"])

    def _calibrated(self, calibration: tuple[float, float, float], memory_factor: float) -> CostModel:
        """The profile's cost model with a saved time calibration ``(s, o forward, o backward)`` and memory factor."""
        model = self.raw_model.calibrated(calibration[0], StageOverhead(*calibration[1:]))
        return model if memory_factor == 1.0 else with_memory_factor(model, self.raw_model.profile.memory, memory_factor)

    def repredict(self, plan: Plan) -> Plan:
        """``plan``'s predicted times on the current cost model: a plan made one step ahead, before the
        last calibration, is simulated again, so that every step's prediction uses the latest fit."""
        return repredict(plan, self.cost_model)

    def predicted_activation_bytes(self, plan: Plan, cost_model: CostModel | None = None) -> list[float]:
        """Per-stage peak activation bytes (model states excluded) by the planner's exact memory walk on
        ``cost_model`` (default: the current one, calibrated)."""
        return activation_bytes(plan, cost_model or self.cost_model).tolist()

    def draw(self, plan: Plan, path: str) -> None:
        draw_timeline(simulate(plan, self.cost_model), plan.num_stages, path, title=plan.summary())


def _calibration(cost_model: CostModel) -> tuple[float, float, float]:
    o = cost_model.profile.overhead
    return cost_model.speed_factor, o.fwd_ms, o.bwd_ms


def _share_plan(plan: Plan | None, timing: tuple[float, float, float] | None) -> tuple[Plan, tuple[float, float, float]]:
    """Give every rank of this model replica (all stages, all tensor ranks) the plan of its first rank
    and its ``(planning ms, of which waited ms, of which inside the last step's span)``."""
    group = ps.get_model_parallel_group()
    box = [(plan.to_json(), timing) if plan is not None else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    text, timing = box[0]
    return Plan.from_json(text), timing


class ElasticTrainStep:
    """A ``training.loop.StepFunction`` over a sequence sampler: plan, broadcast, run; keeps the last step's metrics.

    The first rank of each model replica plans, in a background thread, one global batch ahead. As
    soon as a step's schedule is done, the next step's plan is shared with every rank of the replica
    and each rank builds its inputs for it (:func:`prepare_step`: chunk layouts and batches) in a
    second background thread, while the optimizer steps: the schedule then finds them ready (the
    summary says whether planning was hidden).
    """

    def __init__(self, args: argparse.Namespace, runtime: Runtime, model, sampler, consumed: int, build: PlanBuilder,
                 steps: int | None = None) -> None:
        self.args, self.runtime, self.model, self.build = args, runtime, model, build
        self.batches = sampler.iterate(consumed)
        # the global batches this function will still be asked for (None: no end, as validation): none is drawn,
        # planned or prepared beyond them, so the last step waits for no plan and the exit for no planner thread
        self.batches_left = steps
        self.plans_here = ps.get_model_parallel_group().rank() == 0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epp-planner") if self.plans_here else None
        self.preparer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epp-prepare")
        self.token_multiple = token_multiple(get_model_config(model))  # each chunk padded to it (sequence parallelism)
        self.pending: tuple[Any, Future | None, CostModel] | None = None  # the next batch, its plan's future, the model it is planned on
        self.ready: Future | None = None  # the next step's (batch, plan, planning timing, StepInputs)
        self.last_metrics: ElasticMetrics | None = None
        self.last_plan: Plan | None = None
        self.logged_calibration: tuple[float, float] | None = None
        self.span: tuple[float, float] | None = None  # the last step's forward_backward_elastic (perf_counter)
        self.overlap_ms = 0.0  # the planner's time inside it (the planning rank's, shared with the plan)

    def _plan(self, batch, cost_model: CostModel, memory_factor: float) -> tuple[Plan, float, tuple[float, float]]:
        """Plan ``batch`` on ``cost_model`` (of activation memory factor ``memory_factor``): the plan, with its
        predicted activation peaks on that model; the planning ms; its span (perf_counter)."""
        lengths = batch.seq_lengths[batch.positions(self.runtime.dp_rank)].tolist()
        t0 = time.perf_counter()
        result = self.build(lengths, cost_model).validate()
        elapsed_ms = (time.perf_counter() - t0) * 1000
        result.stats.predicted_activation_bytes = self.build.predicted_activation_bytes(result, cost_model)
        result.stats.memory_factor = memory_factor
        return result, elapsed_ms, (t0, t0 + elapsed_ms / 1000)

    def _plan_async(self, batch, cost_model: CostModel, memory_factor: float) -> Future | None:
        """Plan ``batch`` on ``cost_model`` (the model as this step left it, whatever a later fit makes it)."""
        return None if self.pool is None else self.pool.submit(self._plan, batch, cost_model, memory_factor)

    def _draw(self):
        """The next global batch, or None past the last one this function is asked for."""
        if self.batches_left is not None:
            if self.batches_left == 0:
                return None
            self.batches_left -= 1
        return next(self.batches)

    def _next_planned(self):
        """This step's batch, plan and ``(planning ms, waited ms, planning ms inside the last step's span)``
        (waiting for the planner only if it is still running): the plan was made while the last step ran,
        on the planning rank's core; or None past the last step."""
        build = self.build
        if self.pending is None:  # the first step of this process: planned as the run planned it (a resumed run's too)
            first = self._draw()
            model = build.next_step_model
            self.pending = (first, self._plan_async(first, model, build.next_step_memory_factor) if first is not None else None, model)
        batch, future, planned_on = self.pending
        if batch is None:
            return None
        plan, timing = None, None
        if future is not None:
            t0 = time.perf_counter()
            plan, plan_ms, (start, end) = future.result()
            if planned_on is not build.next_step_model:  # the memory factor changed since: planned again, on the new model
                plan, plan_ms, (start, end) = self._plan(batch, build.next_step_model, build.next_step_memory_factor)
        upcoming = self._draw()
        self.pending = (upcoming, self._plan_async(upcoming, build.cost_model, build.memory_factor) if upcoming is not None else None,
                        build.cost_model)
        if future is not None:
            plan = build.repredict(plan)
            overlap = max(0.0, min(end, self.span[1]) - max(start, self.span[0])) * 1000 if self.span else 0.0
            timing = (plan_ms, (time.perf_counter() - t0) * 1000, overlap)
        return (batch, *_share_plan(plan, timing))

    def _prefetch(self) -> None:
        """Share the next step's plan now (a collective of the replica) and build its inputs in the background;
        nothing after the last step."""
        planned = self._next_planned()
        if planned is None:
            self.ready = None
            return
        batch, plan, timing = planned
        self.overlap_ms = timing[2]
        self.ready = self.preparer.submit(self._prepare, batch, plan, timing)

    def _prepare(self, batch, plan: Plan, timing):
        tensors = [(torch.from_numpy(s.tokens), torch.from_numpy(s.labels)) for s in batch.sequences(self.runtime.dp_rank)]
        return batch, plan, timing, prepare_step(plan, self.runtime.pp_rank, tensors, self.runtime.device, self.token_multiple)

    def __call__(self, forward_only: bool) -> tuple[list[dict[str, torch.Tensor]], np.ndarray]:
        if self.ready is None:
            self._prefetch()
        if self.ready is None:
            raise RuntimeError(f"the elastic step function was asked for more than its {self.args.train_iters} steps")
        batch, plan, (planning_ms, waited_ms, _), inputs = self.ready.result()
        t1 = time.perf_counter()
        with ActivationMemoryTracker(self.runtime.device, ChunkContext.of(self.model)) if not forward_only else contextlib.nullcontext() as memory:
            losses = forward_backward_elastic(
                forward_step_func=elastic_gpt_forward_step,
                data_iterator=iter(inputs.batches),
                model=[self.model],
                num_microbatches=sum(len(p.chunks) for p in plan.pipelines),
                forward_only=forward_only,
                plan=plan,
                layouts=inputs.layouts,
            )
        self.span = (t1, time.perf_counter())
        run_ms = (self.span[1] - t1) * 1000
        measured = None if memory is None else self._gather_stages(memory.peak_bytes)
        if not forward_only:
            self._observe(plan, run_ms, measured)
        self._prefetch()
        self.last_plan = plan
        self.last_metrics = ElasticMetrics(
            plan.summary(), plan.chunk_counts(), len(plan.pipelines), plan.recomputed_layers(), planning_ms, waited_ms,
            plan.stats.predicted_step_ms, run_ms,
            None if memory is None else plan.stats.predicted_activation_bytes, measured,
            planning_overlap_ms=self.overlap_ms,
            padding_tokens=sum(layout.padding for pipe in inputs.layouts for layout in pipe),
            memory_factor=None if memory is None else plan.stats.memory_factor,
        )
        return losses, batch.seq_lengths

    def _observe(self, plan: Plan, run_ms: float, measured_bytes: list[int]) -> None:
        """Give the planner's calibration this step's measured span (the last stage's, as the log records it,
        sent to the planning rank) and every stage's measured activation peak. Only that rank calibrates: it
        alone plans for this model replica and broadcasts the plans, so every rank of the replica runs plans
        of one (calibrated) model. It prints a line when a stage's peak went over the budget and when the
        activation memory factor changes (with calibration off, the first only)."""
        if self.args.epp_calibrate_interval:
            span = torch.tensor([run_ms], dtype=torch.float64, device=self.runtime.device)
            dist.broadcast(span, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
            run_ms = float(span.item())
        if self.plans_here:
            self.build.observe(plan, run_ms, measured_bytes)
            if self.build.memory_note:
                print(self.build.memory_note, flush=True)

    def state_dict(self) -> dict[str, Any]:
        """This rank's planner calibration, for a checkpoint (:meth:`PlanBuilder.state_dict`)."""
        return self.build.state_dict()

    def _gather_stages(self, measured: int) -> list[int]:
        """This rank's measured peak activation bytes, of every stage (gathered over the pipeline)."""
        per_stage: list[Any] = [None] * self.runtime.pp_size
        dist.all_gather_object(per_stage, measured, group=ps.get_pipeline_model_parallel_group())
        return per_stage

    def log(self, iteration: int) -> ElasticMetrics:
        """This step's metrics for the log line and record, with the calibration its prediction used (and a
        line on the logging rank when that changed since the last logged step); with ``--epp-timeline
        DIR``, also that step's timeline picture."""
        if self.args.epp_timeline and self.runtime.rank == 0 and self.last_plan is not None:
            os.makedirs(self.args.epp_timeline, exist_ok=True)
            self.build.draw(self.last_plan, os.path.join(self.args.epp_timeline, f"plan_iter_{iteration:07d}.png"))
        s, o = self.last_plan.stats.speed_factor, self.last_plan.stats.stage_overhead_ms
        if self.runtime.is_logging_rank and self.logged_calibration not in (None, (s, o)):
            was_s, was_o = self.logged_calibration
            print(f" cost model calibrated on this machine's steps: speed factor s {was_s:.3f} -> {s:.3f}, stage overhead "
                  f"o {was_o:.2f} -> {o:.2f} ms per chunk and stage (profile ms; {s * o:.2f} ms here)", flush=True)
        self.logged_calibration = (s, o)
        return dataclasses.replace(self.last_metrics, speed_factor=s, stage_overhead_ms=o)


def elastic_sampler(args: argparse.Namespace, split: str, dp_size: int, build: PlanBuilder):
    """The whole-document sampler of ``split`` ('train'/'valid') for ``dp_size`` replicas, split by
    the planner's modelled work (``build``'s cost model), or None if the split is empty."""
    documents = elastic_documents(args, split)
    if documents is None:
        return None
    # the work vector of the model as built, never a calibrated one: every rank must split the batch the
    # same way, and each replica calibrates its own planner
    return SequenceSampler(documents, args.global_batch_size, args.seq_length, seed=args.seed,
                           dp_size=dp_size, work_vector=build.cost_model.work_vector(), truncate=args.epp_truncate_documents)


def elastic_train_step(args: argparse.Namespace, runtime: Runtime, model, split: str, consumed: int,
                       planner_state: dict[str, Any] | None = None, steps: int | None = None) -> ElasticTrainStep | None:
    """The elastic step function for ``split`` ('train'/'valid'), or None if the split is empty; its planner
    continues from ``planner_state`` (:meth:`PlanBuilder.state_dict`, a checkpoint's) when given; ``steps``: how many
    steps it will run (the training's remaining iterations; None: no end)."""
    build = PlanBuilder(args)
    sampler = elastic_sampler(args, split, runtime.dp_size, build)
    if planner_state is not None:
        build.load_state_dict(planner_state)
    return None if sampler is None else ElasticTrainStep(args, runtime, model, sampler, consumed, build, steps)


def check_memory_budget(args: argparse.Namespace) -> str:
    """Fail before any work if no plan fits the budget for documents of the full context length; else the
    start-up line's account of the budget: how it was found (given, or :mod:`.memory_budget`'s default), the
    model states the planner counts in it (the largest stage's) and what it leaves for activations."""
    docs = max(args.global_batch_size // args.data_parallel_size, 1)
    build = PlanBuilder(args)
    try:
        build([args.seq_length] * docs)
    except PlanInfeasible as error:
        raise ArgumentError(
            f"--epp-memory-budget {args.epp_memory_budget} GB: {docs} documents of --seq-length "
            f"{args.seq_length} tokens per replica cannot be planned ({error})"
        ) from None
    default = getattr(args, "epp_default_budget", None)
    states = float(build.raw_model.model_state_bytes().max())
    return (f"{build.budget_bytes / GIB:.2f} GB per device"
            + (f" = {default.describe()}" if default is not None else " (--epp-memory-budget)")
            + f"; model states {states / GIB:.2f} GB (the cost model's count, largest stage), "
            f"{(build.budget_bytes - states) / GIB:.2f} GB for activations")


def elastic_documents(args: argparse.Namespace, split: str):
    """Whole documents: skewed mock lengths (capped at the context length) or the split of the indexed
    dataset(s) of ``--data-path`` (blended by weight)."""
    if args.mock_data:
        seed = args.seed + (split == "valid")
        lengths = lognormal_lengths(4096, median=max(args.seq_length // 8, 2), sigma=1.2, max_length=args.seq_length + 1, seed=seed)
        return MockDocuments(lengths, args.vocab_size, seed=seed)
    return blended_documents(args.data_blend, args.split, split)
