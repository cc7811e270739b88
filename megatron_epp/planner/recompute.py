"""Stage-aware chunk-level recompute (activation checkpointing, docs/planner.md, "`epp-plan` and the EPP search") as an integer program.

``ckpt(p, k)`` layers of chunk ``k`` recompute on stage ``p``. The anti-diagonal tie
``ckpt(p, k) = ckpt(p + i, k + i)`` leaves one variable per diagonal ``d = k - p + P - 1``
(``n + P - 1`` variables). Minimise the total recompute time subject to, on every stage, the memory
during every backward (the peaks of the exact walk, :mod:`memory`) within the budget. Solved with
``scipy.optimize.milp`` (HiGHS) under a deterministic node limit (and a wall-clock safety limit
scaled with the program's size); the greedy answer is computed too and the better one kept, so the
answer does not depend on the machine's load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from megatron_epp.base.units import GIB
from megatron_epp.simulator.memory import StageMemory

Recompute = Literal["adaptive", "greedy", "none", "full"]  # --epp-recompute
RECOMPUTE_MODES: tuple[Recompute, ...] = get_args(Recompute)


NODE_LIMIT = 500  # branch-and-bound nodes per program: the deterministic work limit
NONZEROS_PER_SECOND = 10_000  # the wall-clock safety limit: ``time_limit`` seconds per this many nonzeros


class MemoryInfeasible(ValueError):
    """Some stage exceeds its memory budget even with every layer checkpointed (or, in mode
    ``"none"``, without checkpointing)."""

    def __init__(self, stage: int, need_bytes: float, budget_bytes: float) -> None:
        super().__init__(f"stage {stage} needs {need_bytes / GIB:.3g} GB > budget {budget_bytes / GIB:.3g} GB")
        self.stage = stage
        self.excess_bytes = need_bytes - budget_bytes


@dataclass
class RecomputeResult:
    recompute: list[list[int]]  # [stage][chunk]
    recompute_ms: float  # total recompute time over all stages
    gap: float  # relative MIP gap of the returned solution (0: proven optimal)
    method: str  # "milp", "greedy", "none", "full"


@dataclass
class _Program:
    """``A x >= rhs``, ``0 <= x <= ub``, cost ``c``, over the diagonal variables (``A`` sparse)."""

    A: sparse.csr_array
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
        coef = (sm.live[rows] * sm.saving[None, :]).tocoo()
        # a row within budget without recompute can still exceed it with recompute: the recompute of a
        # chunk's last checkpointed layer holds more the more layers it checkpoints (negative coefficients)
        growth = np.bincount(coef.row, weights=np.maximum(-coef.data, 0.0), minlength=len(rows))
        keep = need + growth * layers[p] > 0
        if not keep.any():
            continue
        new_row = np.cumsum(keep) - 1
        sel = keep[coef.row]
        blocks.append(sparse.coo_array((coef.data[sel], (new_row[coef.row[sel]], diag[p][coef.col[sel]])), shape=(int(keep.sum()), nv)))
        rhs.append(need[keep])
    A = sparse.vstack(blocks).tocsr() if blocks else sparse.csr_array((0, nv))
    return _Program(A, np.concatenate(rhs) if rhs else np.zeros(0), ub, c, diag)


def _greedy(prog: _Program) -> np.ndarray:
    """Raise the variable with the most bytes per ms on the most violated row until all fit."""
    x = np.zeros_like(prog.ub)
    cost = np.maximum(prog.c, 1e-12)
    A, cols = prog.A, prog.A.tocsc()
    deficit = prog.rhs.copy()
    while len(deficit):
        i = int(np.argmax(deficit))
        if deficit[i] <= 1e-6:
            break
        lo, hi = A.indptr[i], A.indptr[i + 1]
        idx, val = A.indices[lo:hi], A.data[lo:hi]
        room = (x[idx] < prog.ub[idx]) & (val > 0)
        if not room.any():  # raising counts cannot fix this row any more: everything checkpointed (known to fit)
            return prog.ub.copy()
        j = int(np.argmax(np.where(room, val / cost[idx], -1.0)))
        d, a = int(idx[j]), float(val[j])
        step = min(prog.ub[d], x[d] + math.ceil(deficit[i] / a - 1e-9)) - x[d]
        x[d] += step
        lo, hi = cols.indptr[d], cols.indptr[d + 1]
        deficit[cols.indices[lo:hi]] -= step * cols.data[lo:hi]
    return x


def _lp_bound(prog: _Program) -> float | None:
    """The LP relaxation's optimum: a lower bound on the recompute time of every answer."""
    lp = milp(prog.c, bounds=Bounds(0, prog.ub), constraints=LinearConstraint(prog.A, lb=prog.rhs))
    return None if lp.fun is None else float(lp.fun)


def ilp_limits(prog: _Program, time_limit: float) -> dict:
    """HiGHS options for the program: a deterministic work limit (:data:`NODE_LIMIT` branch-and-bound
    nodes; HiGHS is otherwise deterministic: serial MIP, fixed seed), and a wall-clock safety limit of
    ``time_limit`` seconds per :data:`NONZEROS_PER_SECOND` nonzeros of the program (at least
    ``time_limit``), which a solve reaches only on a machine far slower than the node limit assumes."""
    return {"node_limit": NODE_LIMIT, "time_limit": time_limit * max(1.0, prog.A.nnz / NONZEROS_PER_SECOND)}


def solve_recompute(
    mems: list[StageMemory],
    rc_layer: np.ndarray,
    layers: np.ndarray,
    budget: float,
    mode: Recompute = "adaptive",
    time_limit: float = 1.0,
    mip_rel_gap: float = 0.01,
) -> RecomputeResult:
    """Recompute decisions of one pipeline. ``mems``: the walk of every stage; ``budget`` bytes/GPU.
    ``adaptive``: the better of the integer program's answer and the greedy one."""
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
    if not len(prog.rhs):
        return RecomputeResult(none, 0.0, 0.0, "none")
    x, method = _greedy(prog), "greedy"
    lower = None
    if mode == "adaptive":
        scale = np.maximum(prog.rhs, 1.0)  # rows in units of their own deficit: well conditioned
        norm = max(prog.c.max(), 1e-12)
        res = milp(
            prog.c / norm,
            integrality=np.ones_like(prog.c),
            bounds=Bounds(0, prog.ub),
            constraints=LinearConstraint(sparse.diags_array(1.0 / scale) @ prog.A, lb=prog.rhs / scale - 1e-9),
            options={**ilp_limits(prog, time_limit), "mip_rel_gap": mip_rel_gap},
        )
        if res.x is not None:
            lower = float(res.mip_dual_bound) * norm if getattr(res, "mip_dual_bound", None) is not None else None
            ilp = np.round(res.x)
            if prog.c @ ilp <= prog.c @ x and (prog.A @ ilp >= prog.rhs - 1e-6 * np.maximum(prog.rhs, 1.0)).all():
                x, method = ilp, "milp"
    if lower is None:
        lower = _lp_bound(prog)
    objective = float(prog.c @ x)
    gap = 0.0 if lower is None or objective <= 0 else max(0.0, (objective - lower) / objective)
    return RecomputeResult(x[prog.diag].astype(int).tolist(), objective, gap, method)
