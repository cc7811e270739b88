"""The Plan: plain data that the planner makes and the executor and the simulator read (no torch).

:mod:`.core` holds the chunks, pipelines and recompute counts and their checks; :mod:`.order` the
elastic 1F1B op lists of every stage with their sends and receives, which the executor, the simulator and the
memory walk share; :mod:`.report` what the planner predicted of a plan (:class:`PlanReport`), beside it
(:class:`PlannedStep`).
"""

from megatron_epp.plan.core import CHUNK_KINDS, Chunk, ChunkKind, Pipeline, Plan, PlanError, PlanInfeasible, Segment, chunk_kind, split_layers
from megatron_epp.plan.report import MemoryPrediction, PlannedStep, PlanReport

__all__ = ["CHUNK_KINDS", "Chunk", "ChunkKind", "Pipeline", "Plan", "PlanError", "PlanInfeasible", "PlannedStep", "PlanReport", "MemoryPrediction", "Segment", "chunk_kind", "split_layers"]
