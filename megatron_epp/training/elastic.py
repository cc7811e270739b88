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

from megatron_epp.cost.features import chunk_features
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.profiles import StageOverhead, megatron_model_state
from megatron_epp.data.blend import blended_documents
from megatron_epp.data.mock_documents import MockDocuments, lognormal_lengths
from megatron_epp.data.sequence_sampler import SequenceSampler
from megatron_epp.executor.batches import elastic_gpt_forward_step, prepare_step
from megatron_epp.executor.context import ChunkContext, token_multiple
from megatron_epp.executor.memory_tracker import ActivationMemoryTracker
from megatron_epp.executor.schedule import forward_backward_elastic
from megatron_epp.plan import Plan, PlanInfeasible
from megatron_epp.planner.builders import plan_batch
from megatron_epp.planner.calibration import ONLINE_PRIOR_WEIGHT, StepFit, fit_step_model, repredict
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.simulator import simulate
from megatron_epp.simulator.memory import peak_memory
from megatron_epp.simulator.timeline import draw_timeline
from megatron_epp.training.arguments import CALIBRATE_FIRST_STEP, ArgumentError
from megatron_epp.training.initialize import Runtime
from megatron_epp.training.metrics import ElasticMetrics
from megatron_epp.training.profiling import planner_profile
from megatron_epp.training.model import model_shape


class PlanBuilder:
    """The ``--epp-plan`` builder on the planner's cost model for this model and pipeline, calibrated to
    this machine on the measured steps (``--epp-calibrate-interval``)."""

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
        self.calibrate_interval = args.epp_calibrate_interval
        self.measured: deque[tuple[Plan, float]] = deque(maxlen=max(self.calibrate_interval, CALIBRATE_FIRST_STEP - 1))
        self.steps_observed = 0  # training steps of the run (a resumed run's count on from its checkpoint)
        self.warmed_up = False  # the first step of this process has been observed (never fitted on)
        # the cost model the step after the last observed one was planned on (plans are made one step ahead,
        # before the fit that follows the step being run)
        self.next_step_model = self.cost_model

    def __call__(self, lengths: list[int], cost_model: CostModel | None = None) -> Plan:
        """The plan of ``lengths`` on ``cost_model`` (default: the current one)."""
        return plan_batch(lengths, cost_model or self.cost_model, self.config)

    def observe(self, plan: Plan, measured_ms: float) -> StepFit | None:
        """Take a training step's plan and measured span (``forward_backward_elastic`` on the last stage,
        the span the simulator predicts). After step ``CALIBRATE_FIRST_STEP`` and every
        ``--epp-calibrate-interval`` steps after it, refit the speed factor and the per-chunk stage
        overhead on the last steps kept (the first step of each process, a warm-up, never is), and plan the
        following steps on the result; returns the fit when one was made."""
        if not self.calibrate_interval:
            return None
        self.steps_observed += 1
        self.next_step_model = self.cost_model
        if not self.warmed_up:
            self.warmed_up = True
            return None
        self.measured.append((plan, measured_ms))
        since_first = self.steps_observed - CALIBRATE_FIRST_STEP
        if since_first < 0 or since_first % self.calibrate_interval:
            return None
        plans, times = zip(*self.measured)
        fit = fit_step_model(plans, times, self.cost_model, prior_weight=ONLINE_PRIOR_WEIGHT)
        # one reference swap: a plan being made in the planning thread keeps the model it started on
        self.cost_model = fit.apply(self.cost_model)
        return fit

    def state_dict(self) -> dict[str, Any]:
        """The calibration, for a checkpoint: what a run resumed from it needs to plan and refit as this run
        would (same batches and the same measured times given): the current and the next step's cost model
        (as ``(s, o forward, o backward)``), the step count, and the steps the next fit uses."""
        return {"steps_observed": self.steps_observed, "calibration": _calibration(self.cost_model),
                "next_step_calibration": _calibration(self.next_step_model),
                "measured": [(plan.to_json(), ms) for plan, ms in self.measured]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s calibration (a checkpoint's); with ``--epp-calibrate-interval 0``
        keep the profile as given."""
        if not self.calibrate_interval:
            return
        base = self.cost_model
        self.cost_model = base.calibrated(state["calibration"][0], StageOverhead(*state["calibration"][1:]))
        self.next_step_model = base.calibrated(state["next_step_calibration"][0], StageOverhead(*state["next_step_calibration"][1:]))
        self.steps_observed = state["steps_observed"]
        self.measured.clear()
        self.measured.extend((Plan.from_json(text), ms) for text, ms in state["measured"])

    def repredict(self, plan: Plan) -> Plan:
        """``plan``'s predicted times on the current cost model: a plan made one step ahead, before the
        last calibration, is simulated again, so that every step's prediction uses the latest fit."""
        return repredict(plan, self.cost_model)

    def predicted_activation_bytes(self, plan: Plan) -> list[float]:
        """Per-stage peak activation bytes (model states excluded) by the planner's exact memory walk."""
        no_states = np.zeros(plan.num_stages)
        peaks = [peak_memory(p, self.cost_model.costs(chunk_features(p.chunks)), self.cost_model.layers, no_states)
                 for p in plan.pipelines]
        return np.max(peaks, axis=0).tolist()

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
        self.pending: tuple[Any, Future | None] | None = None
        self.ready: Future | None = None  # the next step's (batch, plan, planning timing, StepInputs)
        self.last_metrics: ElasticMetrics | None = None
        self.last_plan: Plan | None = None
        self.logged_calibration: tuple[float, float] | None = None
        self.span: tuple[float, float] | None = None  # the last step's forward_backward_elastic (perf_counter)
        self.overlap_ms = 0.0  # the planner's time inside it (the planning rank's, shared with the plan)

    def _plan_async(self, batch, cost_model: CostModel) -> Future | None:
        """Plan ``batch`` on ``cost_model`` (the model as this step left it, whatever a later fit makes it)."""
        if self.pool is None:
            return None
        lengths = batch.seq_lengths[batch.positions(self.runtime.dp_rank)].tolist()

        def plan() -> tuple[Plan, float, tuple[float, float]]:
            t0 = time.perf_counter()
            result = self.build(lengths, cost_model).validate()
            elapsed_ms = (time.perf_counter() - t0) * 1000
            result.stats.predicted_activation_bytes = self.build.predicted_activation_bytes(result)
            return result, elapsed_ms, (t0, t0 + elapsed_ms / 1000)

        return self.pool.submit(plan)

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
        if self.pending is None:  # the first step of this process: planned as the run planned it (a resumed run's too)
            first = self._draw()
            self.pending = (first, self._plan_async(first, self.build.next_step_model) if first is not None else None)
        batch, future = self.pending
        if batch is None:
            return None
        upcoming = self._draw()
        self.pending = (upcoming, self._plan_async(upcoming, self.build.cost_model) if upcoming is not None else None)
        plan, timing = None, None
        if future is not None:
            t0 = time.perf_counter()
            plan, plan_ms, (start, end) = future.result()
            plan = self.build.repredict(plan)
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
        if not forward_only:
            self._observe(plan, run_ms)
        self._prefetch()
        self.last_plan = plan
        self.last_metrics = ElasticMetrics(
            plan.summary(), plan.chunk_counts(), len(plan.pipelines), plan.recomputed_layers(), planning_ms, waited_ms,
            plan.stats.predicted_step_ms, run_ms,
            None if memory is None else plan.stats.predicted_activation_bytes,
            None if memory is None else self._gather_stages(memory.peak_bytes),
            planning_overlap_ms=self.overlap_ms,
            padding_tokens=sum(layout.padding for pipe in inputs.layouts for layout in pipe),
        )
        return losses, batch.seq_lengths

    def _observe(self, plan: Plan, run_ms: float) -> None:
        """Give the planner's calibration this step's measured span: the last stage's, as the log records
        it, sent to the planning rank. Only that rank calibrates: it alone plans for this model replica
        and broadcasts the plans, so every rank of the replica runs plans of one (calibrated) model."""
        if not self.args.epp_calibrate_interval:
            return
        span = torch.tensor([run_ms], dtype=torch.float64, device=self.runtime.device)
        dist.broadcast(span, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
        if self.plans_here:
            self.build.observe(plan, float(span.item()))

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


def check_memory_budget(args: argparse.Namespace) -> None:
    """Fail before any work if no plan fits the budget for documents of the full context length."""
    docs = max(args.global_batch_size // args.data_parallel_size, 1)
    try:
        PlanBuilder(args)([args.seq_length] * docs)
    except PlanInfeasible as error:
        raise ArgumentError(
            f"--epp-memory-budget {args.epp_memory_budget} GB: {docs} documents of --seq-length "
            f"{args.seq_length} tokens per replica cannot be planned ({error})"
        ) from None


def elastic_documents(args: argparse.Namespace, split: str):
    """Whole documents: skewed mock lengths (capped at the context length) or the split of the indexed
    dataset(s) of ``--data-path`` (blended by weight)."""
    if args.mock_data:
        seed = args.seed + (split == "valid")
        lengths = lognormal_lengths(4096, median=max(args.seq_length // 8, 2), sigma=1.2, max_length=args.seq_length + 1, seed=seed)
        return MockDocuments(lengths, args.vocab_size, seed=seed)
    return blended_documents(args.data_blend, args.split, split)
