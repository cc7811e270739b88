"""Stage-aware chunk-level recompute (activation checkpointing, notes section 5.3) as an integer program.

``ckpt(p, k)`` layers of chunk ``k`` recompute on stage ``p``. The anti-diagonal tie
``ckpt(p, k) = ckpt(p + i, k + i)`` leaves one variable per diagonal ``d = k - p + P - 1``
(``n + P - 1`` variables). Minimise the total recompute time subject to, on every stage, the memory
during every backward (the peaks of the exact walk, :mod:`memory`) within the budget. Solved with
``scipy.optimize.milp`` (HiGHS) under a time limit; a greedy fills in if HiGHS returns no solution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from megatron_epp.planner.config import Recompute
from megatron_epp.simulator.memory import StageMemory


class MemoryInfeasible(ValueError):
    """Some stage exceeds its memory budget even with every layer checkpointed (or, in mode
    ``"none"``, without checkpointing)."""

    def __init__(self, stage: int, need_bytes: float, budget_bytes: float) -> None:
        super().__init__(f"stage {stage} needs {need_bytes / 2**30:.2f} GB > budget {budget_bytes / 2**30:.2f} GB")
        self.stage = stage


@dataclass
class RecomputeResult:
    recompute: list[list[int]]  # [stage][chunk]
    recompute_ms: float  # total recompute time over all stages
    gap: float  # relative MIP gap of the returned solution (0: proven optimal)
    method: str  # "milp", "greedy", "none", "full"


@dataclass
class _Program:
    """``A x >= rhs``, ``0 <= x <= ub``, cost ``c``, over the diagonal variables."""

    A: np.ndarray
    rhs: np.ndarray
    ub: np.ndarray
    c: np.ndarray
    diag: np.ndarray  # (P, n) variable index of (stage, chunk)


def _program(mems: list[StageMemory], rc_layer: np.ndarray, layers: np.ndarray, budget: float) -> _Program:
    P, n = len(mems), len(rc_layer)
    diag = np.arange(n)[None, :] - np.arange(P)[:, None] + P - 1
    nv = n + P - 1
    ub = np.full(nv, np.inf)
    np.minimum.at(ub, diag.ravel(), np.repeat(layers, n).astype(float))
    c = np.bincount(diag.ravel(), weights=np.tile(rc_layer, P), minlength=nv)
    blocks, rhs = [], []
    for p, sm in enumerate(mems):
        rows = sm.bwd_rows
        need = sm.base[rows] - budget
        coef = sm.live[rows] * sm.saving
        # a row within budget without recompute can still exceed it with recompute: the recompute of a
        # chunk's last checkpointed layer holds more the more layers it checkpoints (negative coefficients)
        keep = need + np.maximum(-coef, 0.0).sum(axis=1) * layers[p] > 0
        if not keep.any():
            continue
        coef = coef[keep]
        block = np.zeros((int(keep.sum()), nv))
        block[:, diag[p]] = coef
        blocks.append(block)
        rhs.append(need[keep])
    A = np.vstack(blocks) if blocks else np.zeros((0, nv))
    return _Program(A, np.concatenate(rhs) if rhs else np.zeros(0), ub, c, diag)


def _greedy(prog: _Program) -> np.ndarray:
    """Raise the variable with the most bytes per ms on the most violated row until all fit."""
    x = np.zeros_like(prog.ub)
    cost = np.maximum(prog.c, 1e-12)
    while True:
        deficit = prog.rhs - prog.A @ x
        i = int(np.argmax(deficit)) if len(deficit) else 0
        if not len(deficit) or deficit[i] <= 1e-6:
            return x
        room = (x < prog.ub) & (prog.A[i] > 0)
        if not room.any():  # raising counts cannot fix this row any more: everything checkpointed (known to fit)
            return prog.ub.copy()
        d = int(np.argmax(np.where(room, prog.A[i] / cost, -1.0)))
        x[d] = min(prog.ub[d], x[d] + math.ceil(deficit[i] / prog.A[i, d] - 1e-9))


def _gap_to_lp_bound(prog: _Program, objective: float) -> float:
    """Relative gap of a solution to the LP relaxation's optimum (a lower bound)."""
    lp = milp(prog.c, bounds=Bounds(0, prog.ub), constraints=LinearConstraint(prog.A, lb=prog.rhs))
    if objective <= 0 or lp.fun is None:
        return 0.0
    return max(0.0, (objective - lp.fun) / objective)


def solve_recompute(
    mems: list[StageMemory],
    rc_layer: np.ndarray,
    layers: np.ndarray,
    budget: float,
    mode: Recompute = "adaptive",
    time_limit: float = 0.1,
    mip_rel_gap: float = 0.01,
) -> RecomputeResult:
    """Recompute decisions of one pipeline. ``mems``: the walk of every stage; ``budget`` bytes/GPU."""
    P, n = len(mems), len(rc_layer)
    full = [[int(layers[p])] * n for p in range(P)]
    none = [[0] * n for _ in range(P)]
    for p, sm in enumerate(mems):
        worst = sm.during((none if mode == "none" else full)[p]).max()
        if worst > budget:
            raise MemoryInfeasible(p, worst, budget)
    if mode == "none":
        return RecomputeResult(none, 0.0, 0.0, "none")
    if mode == "full":
        return RecomputeResult(full, float(rc_layer.sum() * layers.sum()), 0.0, "full")
    prog = _program(mems, rc_layer, layers, budget)
    x, gap, method = None, 0.0, "milp"
    if not len(prog.rhs):
        x = np.zeros_like(prog.ub)
    elif mode == "adaptive":
        scale = np.maximum(prog.rhs, 1.0)  # rows in units of their own deficit: well conditioned
        res = milp(
            prog.c / max(prog.c.max(), 1e-12),
            integrality=np.ones_like(prog.c),
            bounds=Bounds(0, prog.ub),
            constraints=LinearConstraint(prog.A / scale[:, None], lb=prog.rhs / scale - 1e-9),
            options={"time_limit": time_limit, "mip_rel_gap": mip_rel_gap},
        )
        if res.x is not None:
            x = np.round(res.x)
            gap = float(res.mip_gap) if res.mip_gap is not None else 0.0
    if x is None:
        x, method = _greedy(prog), "greedy"
        gap = _gap_to_lp_bound(prog, float(prog.c @ x))
    recompute = x[prog.diag].astype(int)
    return RecomputeResult(recompute.tolist(), float(prog.c @ x), gap, method)
