"""What the planner says of a plan, beside the plan: :class:`PlanReport` (what it predicted when it made the plan),
:class:`MemoryPrediction` (the online planner's activation peaks on its calibrated memory model, added after
planning) and :class:`PlannedStep`, a plan with both. The :class:`~megatron_epp.plan.core.Plan` is what to run and
holds none of them; a report is never changed after it is made (a re-prediction on a new calibration is a new one)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from megatron_epp.plan.core import Plan


@dataclass(frozen=True)
class PlanReport:
    """What the planner predicted for a plan on its cost model and budget (simulated; the times in the profile's ms on
    the calibration given by ``speed_factor`` and ``stage_overhead_ms``)."""

    solve_ms: float
    predicted_step_ms: float
    bound_step_ms: float  # compute only: no bubbles, recompute or communication; slowest stage
    bubble_ratio: float
    recompute_ms: float
    peak_memory_bytes: list[float]  # per stage, model states included
    memory_budget_bytes: float  # per device
    fits: bool
    num_chunks: dict[str, int]  # by kind
    num_pipelines: int
    recomputed_layers: int
    # the cost model's calibration the times were predicted with: the speed factor s (measured = s x
    # modelled; 1 on the profile's machine) and the per-chunk stage overhead o (forward + backward, profile ms)
    speed_factor: float
    stage_overhead_ms: float
    # the recompute program (elastic builder only)
    mip_gap: float | None = None
    recompute_method: str | None = None  # "milp", "greedy", "none", "full", or several joined by +
    program_recompute_ms: float | None = None  # the recompute time the program minimised
    # the chunking search's choice (elastic builder only)
    slice_budget_ms: float | None = None
    token_cap: int | None = None
    # the elastic builder's choice among its own plan and the baselines' (planner.builders.ELASTIC)
    chosen: str | None = None  # the builder whose plan won: "epp", "megatron", "seq1f1b-k4", ...
    candidates_ms: dict[str, float] | None = None  # predicted step ms of every candidate that fits
    # activation offload (None: the plan offloads nothing): per stage a GPU's peak host bytes, the copy time no
    # compute hides (summed over stages, in the predicted step)
    host_memory_bytes: list[float] | None = None
    copy_ms: float | None = None


@dataclass(frozen=True)
class MemoryPrediction:
    """The online planner's per-stage peak activation bytes of a plan (model states excluded) on the memory model it
    planned on, and that model's activation memory factor (1: the profile's coefficients)."""

    activation_bytes: list[float]
    memory_factor: float


@dataclass(frozen=True)
class PlannedStep:
    """A plan, the planner's report of it and, from the online planner, its memory prediction."""

    plan: Plan
    report: PlanReport
    memory: MemoryPrediction | None = None

    def summary(self) -> str:
        """:meth:`Plan.summary`, with the plan the elastic builder chose where that is not its own."""
        return self.plan.summary(self.report.chosen)

    def to_json(self) -> str:
        return json.dumps({"plan": self.plan.to_dict(), "report": dataclasses.asdict(self.report),
                           "memory": None if self.memory is None else dataclasses.asdict(self.memory)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "PlannedStep":
        d: dict[str, Any] = json.loads(text)
        return cls(Plan.from_dict(d["plan"]), PlanReport(**d["report"]),
                   None if d["memory"] is None else MemoryPrediction(**d["memory"]))
