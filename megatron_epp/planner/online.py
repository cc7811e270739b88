"""The online planner of ``pretrain_gpt.py --elastic-pp``: each step's plan, calibrated on the measured steps.

:class:`OnlinePlanner` plans a batch with the configured builder (:func:`~megatron_epp.planner.builders.plan_batch`) on the
cost model of one model shape and parallel layout, and recalibrates that model on the steps the training measured
(their times and per-stage activation peaks, as plain numbers) by :mod:`.calibration`. Built from a
:class:`~megatron_epp.planner.config.PlannerConfig`, a :class:`~megatron_epp.cost.shape.ModelShape`, a
:class:`~megatron_epp.base.dims.ParallelDims` and the resolved profile: the training driver turns its flags
into those once (``training.planning.online_planner``), one per run, shared by the memory budget's start-up check,
training and validation. It plans ahead: :meth:`OnlinePlanner.plan_ahead` starts a batch's plan in the planner's
thread and returns a :class:`PlanTicket`; :meth:`OnlinePlanner.take` gives the plan to run, planned again where the
calibration changed the activation memory factor since. The broadcast of the plan and the measurement are the
training's.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from megatron_epp.cost.host import HostLink, local_host_link
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.placement import place_profile
from megatron_epp.cost.profile import Profile, StageOverhead, megatron_model_state
from megatron_epp.cost.shape import ModelShape
from megatron_epp.plan import MemoryPrediction, Plan, PlannedStep
from megatron_epp.planner.builders import plan_batch
from megatron_epp.planner.calibration import (
    ONLINE_PRIOR_WEIGHT, MemoryCheck, StepFit, activation_bytes, fit_memory_factor, fit_step_model, repredict, with_memory_factor,
)
from megatron_epp.base.dims import ParallelDims
from megatron_epp.planner.config import CALIBRATE_FIRST_STEP, PlannerConfig
from megatron_epp.simulator import simulate
from megatron_epp.simulator.timeline import draw_timeline


# after an out-of-memory error the activation memory factor grows at least by this (the measured peak at the failure
# bounds the plan's need from below only: a stage that fails early has not reached its peak)
OOM_FACTOR_STEP = 1.2


@dataclasses.dataclass(frozen=True)
class Planned:
    """A batch's plan (validated) with its report and its predicted activation peaks (``step.memory``), the cost model
    it was planned on, the planner's time on it (ms) and when it ran (``perf_counter`` seconds: start, end)."""

    step: PlannedStep
    cost_model: CostModel
    planning_ms: float
    span: tuple[float, float]


@dataclasses.dataclass(frozen=True)
class PlanTicket:
    """A batch planned ahead (:meth:`OnlinePlanner.plan_ahead`): its lengths, the cost model it is planned on and the
    plan being made in the planner's thread; :meth:`OnlinePlanner.take` gives the plan to run."""

    lengths: list[int]
    cost_model: CostModel | None  # None with planned: take() plans on its own model of that moment
    planned: Future | None  # of a Planned; None: planned by take() (plan_ahead(..., background=False))


class OnlinePlanner:
    """The ``--epp-plan`` builder on the planner's cost model for this model and pipeline, calibrated to
    this machine on the measured steps (``--epp-calibrate-interval``): their times (speed factor and per-chunk
    overhead) and their per-stage activation peaks (the activation memory factor)."""

    def __init__(self, config: PlannerConfig, shape: ModelShape, dims: ParallelDims, profile: Profile, *,
                 distributed_optimizer: bool = False, calibrate_interval: int = 0, host: HostLink | None = None) -> None:
        """``profile``: the resolved profile (at ``dims.tp``), planned on for ``shape`` (named as the profile's model);
        ``distributed_optimizer``: the optimizer states are sharded over ``dims.dp`` (model states);
        ``calibrate_interval``: steps between refits (``--epp-calibrate-interval``; 0: never); ``host``: the node's
        host link offload plans on (``--epp-offload``; the one measured at start-up), default
        :func:`~megatron_epp.cost.host.local_host_link`'s (its copy bandwidth assumed); unused without offload."""
        self.config = config
        shape = dataclasses.replace(shape, name=profile.model.name)
        memory = dataclasses.replace(profile.memory, **megatron_model_state(shape.dtype, distributed_optimizer))
        profile = dataclasses.replace(profile, model=shape, memory=memory, sequence_parallel=dims.sequence_parallel)
        # --epp-offload: the node's host memory and copy bandwidth, which the planner offloads to
        host = (host or local_host_link()) if config.offload != "none" else None
        self.cost_model = CostModel(place_profile(profile, dims), dims.pp, dp=dims.dp, host=host)
        self.raw_model = self.cost_model  # the profile's memory coefficients (memory factor 1), for the raw prediction
        self.calibrate_interval = calibrate_interval
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
        self._thread: ThreadPoolExecutor | None = None  # plans ahead (plan_ahead), made on first use
        self._planned_ahead = False  # plan_ahead was called in this process

    def __call__(self, lengths: list[int], cost_model: CostModel | None = None) -> PlannedStep:
        """The plan of ``lengths`` on ``cost_model`` (default: the current one), validated, with its report."""
        return plan_batch(lengths, cost_model or self.cost_model, self.config)

    def plan_ahead(self, lengths: list[int], *, background: bool = True) -> PlanTicket:
        """Start planning ``lengths`` in the planner's thread, on the current cost model (the first batch this process
        plans: on the model the run planned its next step on, a resumed run's checkpoint's, as the run it resumes
        planned it); one planner's plans are made one at a time, in order. Its plan: :meth:`take`.
        ``background=False`` (``--epp-plan-between-steps``): nothing runs now; :meth:`take` plans it in the caller's
        thread, on the cost model of that moment."""
        if not background:
            return PlanTicket(lengths, None, None)
        model, factor = ((self.cost_model, self.memory_factor) if self._planned_ahead
                         else (self.next_step_model, self.next_step_memory_factor))
        self._planned_ahead = True
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epp-planner")
        return PlanTicket(lengths, model, self._thread.submit(self._plan, lengths, model, factor))

    def take(self, ticket: PlanTicket) -> Planned:
        """The plan of a ticket (waiting for it if it is still being made), planned again here on
        :attr:`next_step_model` where the activation memory factor changed since it was planned, with its
        predicted times on the current cost model (:meth:`repredict`); a ticket not planned in the background is
        planned now, on the current cost model (every observed step's fit in it: a resumed run, whose checkpoint
        holds that model, plans it the same). Raises what planning raised (:class:`~megatron_epp.plan.PlanInfeasible`)."""
        if ticket.planned is None:
            planned = self._plan(ticket.lengths, self.cost_model, self.memory_factor)
        else:
            planned = ticket.planned.result()
            if ticket.cost_model is not self.next_step_model:
                planned = self._plan(ticket.lengths, self.next_step_model, self.next_step_memory_factor)
        return dataclasses.replace(planned, step=self.repredict(planned.step))

    def _plan(self, lengths: list[int], cost_model: CostModel, memory_factor: float) -> Planned:
        """``lengths`` planned on ``cost_model`` (of activation memory factor ``memory_factor``), with the plan's
        predicted activation peaks on that model."""
        t0 = time.perf_counter()
        step = self(lengths, cost_model)
        t1 = time.perf_counter()
        memory = MemoryPrediction(self.predicted_activation_bytes(step.plan, cost_model), memory_factor)
        return Planned(dataclasses.replace(step, memory=memory), cost_model, (t1 - t0) * 1000, (t0, t1))

    def observe(self, plan: Plan, measured_ms: float, measured_activation_bytes: list[float] | None = None) -> StepFit | None:
        """Take a training step's plan, measured span (``forward_backward_elastic`` on the last stage, the span
        the simulator predicts) and, when measured, per-stage activation peaks (:attr:`memory_check`). After
        step ``CALIBRATE_FIRST_STEP`` and every ``--epp-calibrate-interval`` steps after it, refit the speed
        factor and the per-chunk stage overhead on the last steps kept (the first step of each process, a
        warm-up, never is) and the activation memory factor on every step's peaks (:func:`fit_memory_factor`),
        and plan the following steps on the result; a step whose peak (model states + activations) exceeds
        the budget refits the memory factor at once. Returns the time fit when one was made. A change of the
        memory factor makes :attr:`next_step_model` the new model: the step after this one, planned before,
        is planned again on it (:meth:`take`). :attr:`memory_note`: the line to log about it."""
        self.steps_observed += 1
        self.memory_check = check = None if measured_activation_bytes is None else MemoryCheck(
            self.steps_observed, activation_bytes(plan, self.raw_model), np.asarray(measured_activation_bytes, dtype=float),
            self.raw_model.model_state_bytes(), self.config.memory_budget_bytes)
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

    def observe_oom(self, plan: Plan, measured: dict[int, float]) -> float:
        """A run of ``plan`` ran out of memory. ``measured``: per stage of this replica that failed, the activation
        bytes it held when it did (the allocator's peak above the step's start plus the request that failed; on a
        stage that failed early this is below what the plan needs). Raise the activation memory factor to the
        larger of those over the plan's raw prediction and the factor times :data:`OOM_FACTOR_STEP`, whatever
        ``--epp-calibrate-interval`` says (the batch must be planned again on a model that fits it), keep it as the
        floor of later refits, and plan the next steps (and this batch again) on it. Returns the new factor."""
        raw = activation_bytes(plan, self.raw_model)
        ratios = [m / raw[stage] for stage, m in measured.items() if raw[stage] > 0]
        factor = max([self.memory_factor * OOM_FACTOR_STEP, *ratios])
        self.memory_ratio = max(self.memory_ratio, factor)
        model = with_memory_factor(self.cost_model, self.raw_model.profile.memory, factor)
        self.cost_model, self.memory_factor = model, factor
        self.next_step_model, self.next_step_memory_factor = model, factor
        return factor

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

    def repredict(self, step: PlannedStep) -> PlannedStep:
        """``step`` with its predicted times on the current cost model: a plan made one step ahead, before the
        last calibration, is simulated again, so that every step's prediction uses the latest fit."""
        return repredict(step, self.cost_model)

    def predicted_activation_bytes(self, plan: Plan, cost_model: CostModel | None = None) -> list[float]:
        """Per-stage peak activation bytes (model states excluded) by the planner's exact memory walk on
        ``cost_model`` (default: the current one, calibrated)."""
        return activation_bytes(plan, cost_model or self.cost_model).tolist()

    def draw(self, step: PlannedStep, path: str) -> None:
        draw_timeline(simulate(step.plan, self.cost_model), step.plan.num_stages, path, title=step.summary())


def _calibration(cost_model: CostModel) -> tuple[float, float, float]:
    o = cost_model.profile.overhead
    return cost_model.speed_factor, o.fwd_ms, o.bwd_ms
