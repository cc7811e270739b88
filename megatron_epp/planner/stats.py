"""The typed parts of a plan's :class:`~megatron_epp.plan.PlanReport` that the planner's steps produce, and the one
place that puts them together (:func:`plan_report`): the predicted times (:class:`PredictedTimes`, also what a new
calibration re-predicts), the recompute program's summary (:class:`ProgramSummary`) and the chunking search's choice
(:class:`ChunkingChoice`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from megatron_epp.cost.model import CostModel
from megatron_epp.plan import Plan, PlannedStep, PlanReport
from megatron_epp.simulator.step import SimResult


@dataclass(frozen=True)
class PredictedTimes:
    """The time fields of :class:`PlanReport` for a plan simulated on a cost model, with the calibration (speed
    factor, per-chunk stage overhead) they were predicted with."""

    predicted_step_ms: float
    bound_step_ms: float
    bubble_ratio: float
    recompute_ms: float
    speed_factor: float
    stage_overhead_ms: float

    @classmethod
    def of(cls, plan: Plan, cost_model: CostModel, sim: SimResult) -> "PredictedTimes":
        overhead = cost_model.profile.overhead
        return cls(predicted_step_ms=sim.step_ms, bound_step_ms=cost_model.bound_ms(np.array(plan.seq_lengths)),
                   bubble_ratio=sim.bubble_ratio, recompute_ms=sim.recompute_ms, speed_factor=cost_model.speed_factor,
                   stage_overhead_ms=overhead.fwd_ms + overhead.bwd_ms)

    def onto(self, report: PlanReport) -> PlanReport:
        """``report`` with these times."""
        return dataclasses.replace(report, **dataclasses.asdict(self))


@dataclass(frozen=True)
class ProgramSummary:
    """The recompute program's answer over a plan's pipelines (the elastic builder only)."""

    mip_gap: float
    recompute_method: str  # "milp", "greedy", "none", "full", or several joined by +
    program_recompute_ms: float  # the recompute time the program minimised


@dataclass(frozen=True)
class ChunkingChoice:
    """The chunking search's choice (the elastic builder only): the slice budget and the token cap."""

    slice_budget_ms: float
    token_cap: int


def planned_step(plan: Plan, cost_model: CostModel, sim: SimResult, budget: float, solve_ms: float,
                 program: ProgramSummary | None = None, chunking: ChunkingChoice | None = None) -> PlannedStep:
    """``plan`` with what the planner predicts for it (simulated on ``cost_model``: ``sim``) at ``budget`` bytes per GPU."""
    report = PlanReport(
        solve_ms=solve_ms,
        **dataclasses.asdict(PredictedTimes.of(plan, cost_model, sim)),
        peak_memory_bytes=sim.peak_memory.tolist(),
        memory_budget_bytes=float(budget),
        fits=bool((sim.peak_memory <= budget * (1 + 1e-9)).all()),
        num_chunks=plan.chunk_counts(),
        num_pipelines=len(plan.pipelines),
        recomputed_layers=plan.recomputed_layers(),
        mip_gap=None if program is None else program.mip_gap,
        recompute_method=None if program is None else program.recompute_method,
        program_recompute_ms=None if program is None else program.program_recompute_ms,
        slice_budget_ms=None if chunking is None else chunking.slice_budget_ms,
        token_cap=None if chunking is None else chunking.token_cap,
        host_memory_bytes=sim.host_memory.tolist() if plan.offloads() and sim.host_memory is not None else None,
        copy_ms=sim.copy_ms if plan.offloads() else None,
    )
    return PlannedStep(plan, report)
