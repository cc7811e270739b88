"""The planner's settings, one name each: :class:`PlannerConfig`, and their ``--epp-*`` options, shared
by ``epp-plan`` and ``pretrain_gpt.py --elastic-pp``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Literal

from megatron_epp.cost.clusters import CLUSTERS
from megatron_epp.cost.profiles import GIB

BUILDER_NAMES = ("elastic", "megatron", "seq1f1b")
DEFAULT_CLUSTER = "h100-ib-gpu"  # --epp-search-layout's cluster preset
RECOMPUTE_MODES = ("adaptive", "greedy", "none", "full")
# --epp-calibrate-interval: the first fit after this step (the first step is warm-up: lazy initialisation,
# first-touch allocations), on the steps after the warm-up; then every --epp-calibrate-interval steps
CALIBRATE_FIRST_STEP = 5
Recompute = Literal["adaptive", "greedy", "none", "full"]


@dataclass(frozen=True)
class PlannerConfig:
    """What a plan builder needs besides the lengths and the cost model.

    ``builder``: ``elastic`` (EPP), ``megatron`` (packing only) or ``seq1f1b`` (fixed slices);
    ``memory_budget_bytes``: per device (``--epp-memory-budget``, given in GB); ``profile``: the cost-model profile (a preset or a JSON path);
    ``recompute``: ``adaptive`` (the per-(stage, chunk) integer program), ``greedy`` (its greedy
    heuristic), ``none`` or ``full``; ``max_slices``: most slices per sequence (seq1f1b: its ``k``),
    None for the planner's defaults; ``time_limit``: the recompute program's wall-clock safety limit,
    seconds per 10,000 nonzeros (at least this; a deterministic node limit bounds the solve first);
    ``max_seq_len``: the context length (megatron's micro-batch tokens).
    """

    memory_budget_bytes: float
    max_seq_len: int
    profile: str = "auto"
    builder: str = "elastic"
    recompute: Recompute = "adaptive"
    max_slices: int | None = None
    time_limit: float = 1.0

    def __post_init__(self) -> None:
        if self.builder not in BUILDER_NAMES:
            raise ValueError(f"--epp-plan {self.builder!r}: one of {', '.join(BUILDER_NAMES)}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"--epp-recompute {self.recompute!r}: one of {', '.join(RECOMPUTE_MODES)}")
        if self.memory_budget_bytes <= 0:
            raise ValueError("--epp-memory-budget must be positive")
        if self.max_slices is not None and self.max_slices < 1:
            raise ValueError("--epp-max-slices must be >= 1")
        if self.time_limit <= 0:
            raise ValueError("--epp-time-limit must be positive")

    @classmethod
    def from_args(cls, args: argparse.Namespace, max_seq_len: int) -> "PlannerConfig":
        """From the options of :func:`add_planner_arguments` (defaults filled in): the one place the budget's GB
        become bytes."""
        return cls(
            memory_budget_bytes=args.epp_memory_budget * GIB, max_seq_len=max_seq_len, profile=args.epp_profile, builder=args.epp_plan,
            recompute=args.epp_recompute, max_slices=args.epp_max_slices, time_limit=args.epp_time_limit,
        )


def add_planner_arguments(group: Any, defaults: dict[str, Any]) -> None:
    """The ``--epp-*`` planner options on ``group`` (an argparse parser or group), all defaulting to
    None; ``defaults`` (by dest) is only shown in the help: each command line fills in its own."""

    def note(dest: str) -> str:
        return f" (default {defaults[dest]})".replace("%", "%%")

    group.add_argument("--epp-plan", choices=BUILDER_NAMES, default=None,
                       help="plan builder: elastic (EPP), megatron = packing only, seq1f1b = fixed slices" + note("epp_plan"))
    group.add_argument("--epp-memory-budget", type=float, default=None, help="GB per device for the planner" + note("epp_memory_budget"))
    group.add_argument("--epp-profile", default=None,
                       help="cost-model profile: auto (on CUDA a profile measured on this GPU for this dtype, attention kernel and "
                       "layer shape: cached, shipped, or measured at start-up; on CPU as cpu) | analytic (FLOPs at an H100's peak x MFU, "
                       "for the model's shape) | cpu (the shipped CPU profile measured nearest the model) | test-model | llama-7b | "
                       "llama-13b | llama-30b, or a profile JSON path" + note("epp_profile"))
    group.add_argument("--epp-recompute", choices=RECOMPUTE_MODES, default=None,
                       help="per-(stage, chunk) recompute: adaptive = the planner's integer program, greedy = its "
                       "greedy heuristic, none, or full = every layer" + note("epp_recompute"))
    group.add_argument("--epp-max-slices", type=int, default=None,
                       help="most slices per sequence (seq1f1b: its k)" + note("epp_max_slices"))
    group.add_argument("--epp-time-limit", type=float, default=None,
                       help="wall-clock safety limit of the recompute integer program: seconds per 10,000 nonzeros of the "
                       "program, at least this (a deterministic node limit bounds the solve first)" + note("epp_time_limit"))
    group.add_argument("--epp-search-layout", action="store_true", default=None,
                       help="search the parallel layout (TP x CP x PP x DP; CP: --context-parallel-size with --elastic-pp) for this world size, model and "
                       "length distribution on the --epp-cluster preset; print the best flags and exit")
    group.add_argument("--epp-cluster", default=None, choices=sorted(CLUSTERS),
                       help=f"cluster preset of --epp-search-layout (default {DEFAULT_CLUSTER})")
