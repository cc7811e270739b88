"""The baselines and ablations of one batch on the same cost model and simulator (notes section 6):

* ``megatron``, ``seq1f1b``: the other plan builders (:mod:`.builders`);
* ``epp-no-ckpt`` / ``epp-full-ckpt``: the EPP planner without / with full checkpointing;
* ``epp-no-balance``: even-length slices and token-only packing ("w/o workload balance");
* ``flexsp``: adaptive sequence parallelism (:mod:`~megatron_epp.simulator.flexsp`), simulated only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from megatron_epp.plan import Plan, PlanInfeasible
from megatron_epp.cost.model import CostModel
from megatron_epp.planner.epp import build_plan
from megatron_epp.planner.builders import plan_batch, slice_counts
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.simulator.flexsp import plan_flexsp

BASELINES = ("megatron", "seq1f1b", "epp-no-ckpt", "epp-full-ckpt", "epp-no-balance", "flexsp")


def summarize(plan: Plan) -> dict[str, Any]:
    return {k: getattr(plan.stats, k) for k in ("predicted_step_ms", "peak_memory_gb", "bubble_ratio", "recompute_ms", "num_pipelines", "recomputed_layers", "num_chunks")}


def run_baselines(
    lengths: Sequence[int], cost_model: CostModel, config: PlannerConfig, names: Sequence[str] = BASELINES
) -> dict[str, dict[str, Any]]:
    """Predicted step time and peak memory of every baseline; ``{"fits": False, "reason": ...}`` if it cannot fit."""
    budget_bytes = config.memory_budget_bytes

    def epp(builder: str, **kw: Any) -> dict[str, Any]:
        kw.setdefault("recompute", config.recompute)
        plan = build_plan(lengths, cost_model, budget_bytes, slice_counts=slice_counts(config), time_limit=config.time_limit, builder=builder, **kw)
        return summarize(plan)

    makers = {
        "megatron": lambda: summarize(plan_batch(lengths, cost_model, dataclasses.replace(config, builder="megatron"))),
        "seq1f1b": lambda: summarize(plan_batch(lengths, cost_model, dataclasses.replace(config, builder="seq1f1b"))),
        "epp-no-ckpt": lambda: epp("epp-no-ckpt", recompute="none"),
        "epp-full-ckpt": lambda: epp("epp-full-ckpt", recompute="full"),
        "epp-no-balance": lambda: epp("epp-no-balance", balance=False),
        "flexsp": lambda: plan_flexsp(lengths, cost_model, budget_bytes),
    }
    out = {}
    for name in names:
        try:
            out[name] = {"fits": True, **makers[name]()}
        except PlanInfeasible as e:
            out[name] = {"fits": False, "reason": str(e)}
    return out
