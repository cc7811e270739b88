"""The EPP planner: cost model, chunking, grouping, checkpointing, simulation, baselines.

Entry points: :func:`build_plan` (an elastic plan for a batch) and :func:`simulate` (any Plan).
"""

from megatron_epp.planner.builder import PlanInfeasible, build_plan
from megatron_epp.planner.cost_model import CostModel
from megatron_epp.planner.network import NETWORKS, get_network
from megatron_epp.planner.profiles import Profile, analytic_profile, load_model
from megatron_epp.planner.simulator import SimResult, simulate

__all__ = [
    "NETWORKS",
    "CostModel",
    "PlanInfeasible",
    "Profile",
    "SimResult",
    "analytic_profile",
    "build_plan",
    "get_network",
    "load_model",
    "simulate",
]
