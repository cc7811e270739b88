"""The Plan: plain data that the planner makes and the executor and the simulator read (no torch).

:mod:`.core` holds the chunks, pipelines and recompute counts and their checks; :mod:`.order` the
elastic 1F1B op lists of every stage with their sends and receives, which the executor, the simulator and the
memory walk share.
"""

from megatron_epp.plan.core import CHUNK_KINDS, Chunk, ChunkKind, Pipeline, Plan, PlanError, PlanInfeasible, PlanStats, Segment, chunk_kind, split_layers

__all__ = ["CHUNK_KINDS", "Chunk", "ChunkKind", "Pipeline", "Plan", "PlanError", "PlanInfeasible", "PlanStats", "Segment", "chunk_kind", "split_layers"]
