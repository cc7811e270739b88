"""``--elastic-pp``: whole documents per global batch, a new plan every step, the elastic schedule."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel.utils import get_pp_last_rank
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

from megatron_epp.executor.batches import elastic_gpt_forward_step, prepare_step
from megatron_epp.executor.context import ChunkContext, token_multiple
from megatron_epp.executor.memory_tracker import ActivationMemoryTracker
from megatron_epp.executor.schedule import OpFailure, StepOutOfMemory, allocator_figures, forward_backward_elastic
from megatron_epp.plan import Plan, PlannedStep, PlanInfeasible
from megatron_epp.planner.builders import baseline_ratios
from megatron_epp.planner.online import OnlinePlanner, PlanTicket
from megatron_epp.base.units import GIB
from megatron_epp.training.faults import FaultInjection, TrainingFault
from megatron_epp.model.runtime import Runtime
from megatron_epp.training.metrics import ElasticMetrics
from megatron_epp.training.planning import elastic_sampler
from megatron_epp.config.fields import TrainingConfig

OOM_TRIES = 4  # plans of one batch that may run out of memory before the run stops (the last one's error stops it)
OOM_BUDGET_HINT = 0.8  # the --epp-memory-budget the stopping line suggests: this share of the run's


def give_up_line(what: str, factor: float, budget_bytes: float) -> str:
    """The reason a run stops after :data:`OOM_TRIES` plans of a batch ran out of memory: the activation memory factor
    the planner holds now, and a budget to try (:data:`OOM_BUDGET_HINT` of the run's, rounded down to two significant
    digits) beside the run's, each at the precision the value needs (a budget of 0.008 GB is not "0.0")."""
    now = budget_bytes / GIB
    digits = 1 - math.floor(math.log10(OOM_BUDGET_HINT * now))  # decimals that keep two significant digits
    hint = math.floor(OOM_BUDGET_HINT * now * 10**digits + 1e-9) / 10**digits
    return (f"{what}, on each of {OOM_TRIES} plans of this batch (activation memory factor now {factor:.3f}): lower the "
            f"memory budget, e.g. --epp-memory-budget {hint:g} (now {now:.4g})")

class RngStates:
    """The random number generators a step draws from (torch's CPU and CUDA generators, megatron-core's
    tensor-parallel RNG tracker), as they were when taken: a batch run again after an out-of-memory error draws
    what its first run drew (dropout masks), so that no RNG advance is lost or doubled."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device
        self.tracker = dict(tensor_parallel.get_cuda_rng_tracker().get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        tensor_parallel.get_cuda_rng_tracker().set_states(dict(self.tracker))


@dataclasses.dataclass(frozen=True)
class OomReport:
    """One rank's part of a step that ran out of memory somewhere: its rank and replica, its failure (None where it
    did not fail) and its activation peak up to the end of the step (bytes above the step's start; the allocator's
    reserved peak on CUDA, what autograd saved on CPU; None in evaluation, which is not measured)."""

    rank: int
    dp_rank: int
    failure: OpFailure | None
    peak_bytes: int | None

    def line(self) -> str:
        f = self.failure
        peak = "" if self.peak_bytes is None else f", activation peak {_size(self.peak_bytes)} above the step's start"
        asked = "" if f.requested_bytes is None else f" asking for {_size(f.requested_bytes)} more"
        figures = allocator_figures(f.message)
        return f"stage {f.stage} (rank {self.rank}) in {f.describe()}{asked}{peak}" + (f" (CUDA: {figures})" if figures else "")


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MB"


def _share_plan(step: PlannedStep | None, timing: tuple[float, float, float] | None,
                groups: ProcessGroupCollection) -> tuple[PlannedStep, tuple[float, float, float]]:
    """Give every rank of this model replica (all stages, all tensor and context-parallel ranks) the plan of its first
    rank, with its report and memory prediction, and its ``(planning ms, of which waited ms, of which inside the last
    step's span)``: over the context-parallel group of the model-parallel groups' first ranks (they share one), then over
    each model-parallel group (``groups``: the rank's process groups)."""
    group = groups.mp
    box = [(step.to_json(), timing) if step is not None else None]
    cp_group = groups.cp
    if cp_group.size() > 1 and group.rank() == 0:  # every rank of a context-parallel group has the same model-parallel rank
        dist.broadcast_object_list(box, src=dist.get_global_rank(cp_group, 0), group=cp_group)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    text, timing = box[0]
    return PlannedStep.from_json(text), timing


class ElasticTrainStep:
    """A :class:`~megatron_epp.training.step.TrainStep` over a sequence sampler: plan, broadcast, run; keeps the last
    step's metrics.

    The first rank of each model replica plans, in a background thread, one global batch ahead. As
    soon as a step's schedule is done, the next step's plan is shared with every rank of the replica
    and each rank builds its inputs for it (:func:`prepare_step`: chunk views and batches) in a
    second background thread, while the optimizer steps: the schedule then finds them ready (the
    summary says whether planning was hidden).

    A run of the batch in which any rank ran out of memory (:class:`StepOutOfMemory`, raised on every rank by the
    schedule before any gradient is reduced) is run again, up to :data:`OOM_TRIES` plans of it: the RNG states as
    the batch's first run found them, the gradient buffers zeroed, the memory released, the planner's memory factor
    raised (:meth:`OnlinePlanner.observe_oom`) and the batch planned again; the loop above sees one step.
    """

    def __init__(self, cfg: TrainingConfig, runtime: Runtime, model, sampler, consumed: int, planner: OnlinePlanner,
                 steps: int | None = None, faults: FaultInjection = FaultInjection()) -> None:
        self.cfg, self.runtime, self.model, self.planner, self.faults = cfg, runtime, model, planner, faults
        self.iteration = consumed // cfg.training.global_batch_size  # training iterations done (the fault hook's count)
        self.tracker: ActivationMemoryTracker | None = None  # the last run's
        self.batches = sampler.iterate(consumed)
        # the global batches this function will still be asked for (None: no end, as validation): none is drawn,
        # planned or prepared beyond them, so the last step waits for no plan and the exit for no planner thread
        self.batches_left = steps
        self.groups: ProcessGroupCollection = runtime.pg_collection
        self.plans_here = self.groups.mp.rank() == 0 and runtime.cp_rank == 0  # one planner per replica
        self.preparer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epp-prepare")
        self.token_multiple = token_multiple(get_model_config(model))  # each chunk padded to it (sequence parallelism)
        self.pending: tuple[Any, PlanTicket | None] | None = None  # the next batch and its plan's ticket (the planning rank's)
        self.ready: Future | None = None  # the next step's (batch, PlannedStep, planning timing, StepInputs)
        self.last_metrics: ElasticMetrics | None = None
        self.last_step: PlannedStep | None = None
        self.logged_calibration: tuple[float, float] | None = None
        self.span: tuple[float, float] | None = None  # the last step's forward_backward_elastic (perf_counter)
        self.overlap_ms = 0.0  # the planner's time inside it (the planning rank's, shared with the plan)

    def _plan_ahead(self, batch) -> PlanTicket | None:
        """Start planning ``batch`` in the planner's thread, or with ``--epp-plan-between-steps`` when the planner takes
        its ticket (the planning rank; None elsewhere and past the last batch)."""
        if batch is None or not self.plans_here:
            return None
        return self.planner.plan_ahead(batch.seq_lengths[batch.positions(self.runtime.dp_rank)].tolist(),
                                       background=not self.cfg.epp.plan_between_steps)

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
        if self.pending is None:  # the first step of this process
            first = self._draw()
            self.pending = (first, self._plan_ahead(first))
        batch, ticket = self.pending
        if batch is None:
            return None
        step, timing = None, None
        t0 = time.perf_counter()
        planned = None if ticket is None else self.planner.take(ticket)
        upcoming = self._draw()
        self.pending = (upcoming, self._plan_ahead(upcoming))
        if planned is not None:
            step, (start, end) = planned.step, planned.span
            overlap = max(0.0, min(end, self.span[1]) - max(start, self.span[0])) * 1000 if self.span else 0.0
            timing = (planned.planning_ms, (time.perf_counter() - t0) * 1000, overlap)
        return (batch, *_share_plan(step, timing, self.groups))

    def _prefetch(self) -> None:
        """Share the next step's plan now (a collective of the replica) and build its inputs in the background;
        nothing after the last step."""
        planned = self._next_planned()
        if planned is None:
            self.ready = None
            return
        batch, step, timing = planned
        self.overlap_ms = timing[2]
        self.ready = self.preparer.submit(self._prepare, batch, step, timing)

    def _prepare(self, batch, step: PlannedStep, timing):
        tensors = [(torch.from_numpy(s.tokens), torch.from_numpy(s.labels))
                   + (() if s.loss_mask is None else (torch.from_numpy(s.loss_mask),)) for s in batch.sequences(self.runtime.dp_rank)]
        return batch, step, timing, prepare_step(step.plan, self.runtime.pp_rank, tensors, self.runtime.device, self.token_multiple,
                                                 self.runtime.cp_rank, self.runtime.dims.cp)

    def __call__(self, forward_only: bool) -> tuple[list[dict[str, torch.Tensor]], np.ndarray]:
        if self.ready is None:
            self._prefetch()
        if self.ready is None:
            raise RuntimeError(f"the elastic step function was asked for more than its {self.cfg.training.train_iters} steps")
        batch, step, (planning_ms, waited_ms, _), inputs = self.ready.result()
        self.iteration += not forward_only
        rng = RngStates(self.runtime.device)
        for attempt in range(1, OOM_TRIES + 1):
            try:
                losses, run_ms = self._run(step.plan, inputs, forward_only, attempt)
                break
            except StepOutOfMemory as oom:
                rng.restore()
                step, inputs = self._after_oom(batch, step, oom, attempt, forward_only)
        memory = self.tracker
        measured, per_cp = (None, None) if memory is None else self._stage_peaks(memory.peak_bytes)
        allocated = None if memory is None else self._stage_peaks(memory.peak_allocated)[0]
        host = None if memory is None or step.report.host_memory_bytes is None else self._host_peaks(memory)
        if not forward_only:
            self._observe(step.plan, run_ms, measured)
        self._prefetch()
        self.last_step = step
        plan, report = step.plan, step.report
        self.last_metrics = ElasticMetrics(
            step.summary(), plan.chunk_counts(), len(plan.pipelines), plan.recomputed_layers(), planning_ms, waited_ms,
            report.predicted_step_ms, run_ms,
            None if memory is None else step.memory.activation_bytes, measured,
            planning_overlap_ms=self.overlap_ms,
            padding_tokens=sum(view.padding for pipe in inputs.views for view in pipe),
            memory_factor=None if memory is None else step.memory.memory_factor,
            measured_allocated_bytes=allocated if allocated != measured else None,
            model_state_bytes=None if memory is None else self.planner.raw_model.model_state_bytes().tolist(),
            memory_budget_bytes=None if memory is None else self.planner.config.memory_budget_bytes,
            oom_retries=attempt - 1,
            baseline_ratios=baseline_ratios(report),
            measured_cp_activation_bytes=per_cp,
            offloaded_layers=plan.offloaded_layers(),
            predicted_host_bytes=step.report.host_memory_bytes,
            measured_host_bytes=host,
        )
        return losses, batch.seq_lengths

    def _run(self, plan: Plan, inputs, forward_only: bool, attempt: int) -> tuple[list[dict[str, torch.Tensor]], float]:
        """One run of ``plan``: the last stage's losses and the span's ms. The span starts after the memory tracker's
        device synchronisation (the previous optimizer step's tail is not this step's) and ends after its last one."""
        context = ChunkContext.of(self.model)
        if not forward_only:  # test-only (EPP_FAULT_INJECT=oom@...)
            context.fault_hook = self.faults.oom_hook(self.iteration, self.runtime.rank, attempt)
        self.tracker = None if forward_only else ActivationMemoryTracker(self.runtime.device, context)
        try:
            with self.tracker if self.tracker is not None else contextlib.nullcontext():
                t1 = time.perf_counter()
                losses = forward_backward_elastic(
                    forward_step_func=elastic_gpt_forward_step,
                    data_iterator=iter(inputs.batches),
                    model=[self.model],
                    num_microbatches=sum(len(p.chunks) for p in plan.pipelines),
                    forward_only=forward_only,
                    pg_collection=self.groups,
                    plan=plan,
                    views=inputs.views,
                )
        finally:
            context.fault_hook = None
        self.span = (t1, time.perf_counter())
        return losses, (self.span[1] - t1) * 1000

    def _after_oom(self, batch, step: PlannedStep, oom: StepOutOfMemory, attempt: int, forward_only: bool):
        """Every rank, after a run of ``step``'s plan in which some rank ran out of memory: release the step's memory, raise
        the planner's activation memory factor from what was measured, and plan the batch again (one line on the
        first rank); after :data:`OOM_TRIES` plans, :class:`TrainingFault`. Returns the new plan and its inputs."""
        mine = OomReport(self.runtime.rank, self.runtime.dp_rank, oom.failure,
                         None if self.tracker is None else self.tracker.peak_bytes)
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, mine)
        failed = [r for r in reports if r.failure is not None]
        if not forward_only:
            self.model.zero_grad_buffer()  # the failed run's partial accumulation
        gc.collect()
        if self.runtime.device.type == "cuda":
            torch.cuda.empty_cache()
        before = self.planner.memory_factor
        if self.plans_here:  # this replica's failures, measured against this replica's plan
            self.planner.observe_oom(step.plan, {r.failure.stage: r.peak_bytes + (r.failure.requested_bytes or 0)
                                            for r in failed if r.dp_rank == self.runtime.dp_rank and r.peak_bytes is not None})
        what = (f"iteration {self.iteration}" if not forward_only else "an evaluation step") + ": out of memory on " + "; ".join(r.line() for r in failed)
        if attempt == OOM_TRIES:
            # the factor this replica's planner holds now (the planning rank's: the others never raise theirs)
            factors: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(factors, (self.runtime.dp_rank, self.planner.memory_factor) if self.plans_here else None)
            factor = next(f for dp, f in filter(None, factors) if dp == self.runtime.dp_rank)
            raise TrainingFault(give_up_line(what, factor, self.planner.config.memory_budget_bytes))
        step = self._plan_again(batch, what)
        if self.runtime.rank == 0:
            print(f" {what}: the step's memory released, nothing applied; activation memory factor {before:.3f} -> "
                  f"{self.planner.memory_factor:.3f}, the batch planned again ({step.summary()}; try {attempt + 1} of {OOM_TRIES})", flush=True)
        return step, self._prepare(batch, step, None)[3]

    def _plan_again(self, batch, what: str) -> PlannedStep:
        """Every rank: the batch planned again on the planner's model as it is now (after the previous step's plan in
        the planning thread), shared with the replica; :class:`TrainingFault` on every rank where some replica's batch
        can no longer be planned within the budget."""
        step, error = None, None
        if self.plans_here:
            try:
                step = self.planner.take(self._plan_ahead(batch)).step
            except PlanInfeasible as infeasible:
                error = str(infeasible)
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise TrainingFault(f"{what}; planned again at activation memory factor {self.planner.memory_factor:.2f}, "
                                f"the batch no longer fits: {first}")
        return _share_plan(step, None, self.groups)[0]

    def _observe(self, plan: Plan, run_ms: float, measured_bytes: list[int]) -> None:
        """Give the planner's calibration this step's measured span (the last stage's, as the log records it,
        sent to the planning rank) and every stage's measured activation peak. Only that rank calibrates: it
        alone plans for this model replica and broadcasts the plans, so every rank of the replica runs plans
        of one (calibrated) model. It prints a line when a stage's peak went over the budget and when the
        activation memory factor changes (with calibration off, the first only)."""
        if self.cfg.epp.calibrate_interval:
            span = torch.tensor([run_ms], dtype=torch.float64, device=self.runtime.device)
            dist.broadcast(span, src=get_pp_last_rank(self.groups.pp), group=self.groups.pp)
            run_ms = float(span.item())
        if self.plans_here:
            self.planner.observe(plan, run_ms, measured_bytes)
            if self.planner.memory_note:
                print(self.planner.memory_note, flush=True)

    def state_dict(self) -> dict[str, Any]:
        """This rank's planner calibration, for a checkpoint (:meth:`OnlinePlanner.state_dict`)."""
        return self.planner.state_dict()

    def _host_peaks(self, memory: ActivationMemoryTracker) -> list[int]:
        """The host pool's peak of every stage (the largest of its ranks'), with the K/V gradient accumulators on the host
        where the planner counts them (``kv_grad``: an allocator's measurement, CUDA)."""
        kv_grad = self.planner.raw_model.profile.memory.kv_grad
        return self._stage_peaks(memory.peak_host_with_grads if kv_grad else memory.peak_host_bytes)[0]

    def _stage_peaks(self, measured: int) -> tuple[list[int], list[list[int]] | None]:
        """Of every stage, the largest of its ranks' ``measured`` and, under context parallelism, each CP rank's
        (``[stage][cp rank]``; None without it)."""
        if self.runtime.dims.cp == 1:
            return self._gather_stages(measured), None
        per_cp = self._gather_stages(measured, by_cp_rank=True)
        return [max(stage) for stage in per_cp], per_cp

    def _gather_stages(self, measured: int, by_cp_rank: bool = False) -> list[Any]:
        """This rank's measured peak activation bytes, of every stage (gathered over the pipeline); ``by_cp_rank``: of
        every stage and context-parallel rank (``[stage][cp rank]``, gathered over the context-parallel group first)."""
        if by_cp_rank:
            mine: Any = [None] * self.runtime.dims.cp
            dist.all_gather_object(mine, measured, group=self.groups.cp)
            measured = mine
        per_stage: list[Any] = [None] * self.runtime.dims.pp
        dist.all_gather_object(per_stage, measured, group=self.groups.pp)
        return per_stage

    def log(self, iteration: int) -> ElasticMetrics:
        """This step's metrics for the log line and record, with the calibration its prediction used (and a
        line on the logging rank when that changed since the last logged step); with ``--epp-timeline
        DIR``, also that step's timeline picture."""
        if self.cfg.epp.timeline and self.runtime.rank == 0 and self.last_step is not None:
            os.makedirs(self.cfg.epp.timeline, exist_ok=True)
            self.planner.draw(self.last_step, os.path.join(self.cfg.epp.timeline, f"plan_iter_{iteration:07d}.png"))
        s, o = self.last_step.report.speed_factor, self.last_step.report.stage_overhead_ms
        if self.runtime.is_logging_rank and self.logged_calibration not in (None, (s, o)):
            was_s, was_o = self.logged_calibration
            print(f" cost model calibrated on this machine's steps: speed factor s {was_s:.3f} -> {s:.3f}, stage overhead "
                  f"o {was_o:.2f} -> {o:.2f} ms per chunk and stage (profile ms; {s * o:.2f} ms here)", flush=True)
        self.logged_calibration = (s, o)
        return dataclasses.replace(self.last_metrics, speed_factor=s, stage_overhead_ms=o)


def elastic_train_step(cfg: TrainingConfig, planner: OnlinePlanner, runtime: Runtime, model, split: str, consumed: int,
                       planner_state: dict[str, Any] | None = None, steps: int | None = None,
                       faults: FaultInjection = FaultInjection()) -> ElasticTrainStep | None:
    """The elastic step function for ``split`` ('train'/'valid'), or None if the split is empty, planning with
    ``planner`` (the run's one, shared by training and validation); the planner
    continues from ``planner_state`` (:meth:`OnlinePlanner.state_dict`, a checkpoint's) when given; ``steps``: how many
    steps it will run (the training's remaining iterations; None: no end)."""
    sampler = elastic_sampler(cfg, split, runtime.dims.dp, planner)
    if planner_state is not None:
        planner.load_state_dict(planner_state)
    return None if sampler is None else ElasticTrainStep(cfg, runtime, model, sampler, consumed, planner, steps, faults)
