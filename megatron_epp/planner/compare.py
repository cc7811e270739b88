"""The baselines and ablations of one batch on the same cost model and simulator (docs/planner.md, docs/baselines.md):

* ``megatron``, ``seq1f1b``: the other plan builders (:mod:`.builders`);
* ``epp-no-ckpt`` / ``epp-full-ckpt``: the EPP planner without / with full checkpointing;
* ``epp-no-balance``: even-length slices and token-only packing ("w/o workload balance");
* ``flexsp``: adaptive sequence parallelism (:mod:`~megatron_epp.simulator.flexsp`), simulated only.

The first five are :class:`~megatron_epp.planner.builders.Builder` records (:data:`COMPARED`); ``flexsp`` plans no
:class:`Plan`.
"""

from __future__ import annotations

from typing import Any, Sequence

from megatron_epp.plan import PlannedStep, PlanInfeasible
from megatron_epp.cost.model import CostModel
from megatron_epp.planner.epp import build_plan
from megatron_epp.planner.builders import MEGATRON, SEQ1F1B, BaselinePlans, Builder, slice_counts
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.simulator.flexsp import plan_flexsp


def _ablation(name: str, **options: Any) -> Builder:
    """The EPP planner (:func:`build_plan`) with ``options`` set, its plans named ``name``."""

    def build(lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig, known: BaselinePlans | None) -> PlannedStep:
        kw = {"recompute": config.recompute, **options}
        return build_plan(lengths, cost_model, config.memory_budget_bytes, slice_counts=slice_counts(config), time_limit=config.time_limit,
                          builder=name, **kw)

    return Builder(name, build)


COMPARED: dict[str, Builder] = {b.name: b for b in (
    MEGATRON, SEQ1F1B, _ablation("epp-no-ckpt", recompute="none"), _ablation("epp-full-ckpt", recompute="full"),
    _ablation("epp-no-balance", balance=False))}
FLEXSP = "flexsp"
BASELINES = (*COMPARED, FLEXSP)  # --baselines' names, the JSON's keys


def summarize(step: PlannedStep) -> dict[str, Any]:
    return {k: getattr(step.report, k) for k in ("predicted_step_ms", "peak_memory_bytes", "bubble_ratio", "recompute_ms", "num_pipelines", "recomputed_layers", "num_chunks")}


def run_baselines(
    lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig, names: Sequence[str] = BASELINES
) -> dict[str, dict[str, Any]]:
    """Predicted step time and peak memory (bytes per stage, ``peak_memory_bytes``) of every baseline (``names``: of
    :data:`BASELINES`); ``{"fits": False, "reason": ...}`` if it cannot fit."""
    out = {}
    for name in names:
        try:
            summary = plan_flexsp(lengths, cost_model, config.memory_budget_bytes) if name == FLEXSP else summarize(
                COMPARED[name].plan(lengths, cost_model, config))
            out[name] = {"fits": True, **summary}
        except PlanInfeasible as e:
            out[name] = {"fits": False, "reason": str(e)}
    return out
