"""The EPP planner: a batch's sequence lengths -> a Plan and its report (numpy and scipy only, no torch).

Chunking (:mod:`.chunking`), grouping into 1F1B pipelines (:mod:`.grouping`), per-stage recompute
as an integer program (:mod:`.recompute`), the EPP builder (:mod:`.epp`), the typed parts of a plan's report
(:mod:`.stats`); the settings (:mod:`.config`, ``--epp-*``), the builders elastic|megatron|seq1f1b as typed
records in one registry (:mod:`.builders`), the data-parallel split (:mod:`.data_parallel`); :mod:`.compare` predicts the
baselines and ablations on one batch (``epp-plan``, :mod:`.cli`); :mod:`.online` is the training's planner,
calibrated on its measured steps. Lengths come from data (:mod:`megatron_epp.data.lengths`); training is never imported.
"""

from megatron_epp.plan import PlanInfeasible
from megatron_epp.planner.epp import build_plan

__all__ = ["PlanInfeasible", "build_plan"]
