"""The EPP planner: a batch's sequence lengths -> a Plan (numpy and scipy only, no torch).

Chunking (:mod:`.chunking`), grouping into 1F1B pipelines (:mod:`.grouping`), per-stage recompute
as an integer program (:mod:`.recompute`), the EPP builder (:mod:`.builder`) and the baseline
builders (:mod:`.baselines`); :mod:`.compare` predicts all of them on one batch (``epp-plan``).
"""

from megatron_epp.plan import PlanInfeasible
from megatron_epp.planner.builder import build_plan

__all__ = ["PlanInfeasible", "build_plan"]
