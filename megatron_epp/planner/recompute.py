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
from megatron_epp.cost.host import HostLink
from megatron_epp.simulator.memory import StageMemory
from megatron_epp.simulator.offload import CopyBytes

Recompute = Literal["adaptive", "greedy", "none", "full"]  # --epp-recompute
RECOMPUTE_MODES: tuple[Recompute, ...] = get_args(Recompute)
# --epp-offload: none; checkpoints (the program may move checkpoints to the host); auto (and, where the device cannot
# hold them, the K/V buffers of a pipeline's split sequences)
Offload = Literal["none", "checkpoints", "auto"]
OFFLOAD_MODES: tuple[Offload, ...] = get_args(Offload)


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
    recompute_ms: float  # total recompute time over all stages (with offload: and the exposed copy time)
    gap: float  # relative MIP gap of the returned solution (0: proven optimal)
    method: str  # "milp", "greedy", "none", "full"
    offload: list[list[int]] | None = None  # [stage][chunk] offloaded checkpoints (None: offload not planned)
    copy_ms: float = 0.0  # the exposed copy time over all stages (part of recompute_ms)


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


def ilp_limits(prog: _Program | _OffloadProgram, time_limit: float) -> dict:
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
    offload: OffloadSetting | None = None,
) -> RecomputeResult:
    """Recompute decisions of one pipeline. ``mems``: the walk of every stage; ``budget`` bytes/GPU.
    ``adaptive``: the better of the integer program's answer and the greedy one. ``offload``: checkpoints may go to
    the host too (:func:`solve_offload`); None: recompute alone, as before offload existed."""
    if offload is not None:
        return solve_offload(mems, rc_layer, layers, budget, mode, time_limit, mip_rel_gap, offload)
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



# ----------------------------------------------------------------------------- activation offload
class HostMemoryInfeasible(MemoryInfeasible):
    """A stage's GPU needs more host memory than ``--epp-host-memory-budget`` allows (its K/V buffers on the host)."""

    def __init__(self, stage: int, need_bytes: float, budget_bytes: float) -> None:
        ValueError.__init__(self, f"stage {stage} needs {need_bytes / GIB:.3g} GB of host memory per GPU > "
                            f"--epp-host-memory-budget {budget_bytes / GIB:.3g} GB")
        self.stage = stage
        self.excess_bytes = need_bytes - budget_bytes


@dataclass
class OffloadSetting:
    """What the program needs to offload checkpoints (docs/planner.md, "Activation offload"): the host link, the host
    budget per GPU (bytes), the chunks' forward and backward times per (stage, chunk) (the compute copies hide
    behind), and the copies that do not depend on the decision (the K/V buffers on the host:
    :class:`~megatron_epp.simulator.offload.CopyBytes`)."""

    host: HostLink
    host_budget: float
    fwd: np.ndarray
    bwd: np.ndarray
    kv: CopyBytes


class _Rows:
    """``A x >= rhs`` assembled row block by row block (coordinates)."""

    def __init__(self, width: int) -> None:
        self.width, self.data, self.row, self.col, self.rhs = width, [], [], [], []

    def add(self, rhs: np.ndarray, *terms: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Rows ``sum of data at (row, col) >= rhs``; ``row`` indexes ``rhs``."""
        base = sum(len(r) for r in self.rhs)
        for data, row, col in terms:
            self.data.append(np.asarray(data, dtype=float))
            self.row.append(np.asarray(row) + base)
            self.col.append(np.asarray(col))
        self.rhs.append(np.asarray(rhs, dtype=float))

    def build(self) -> tuple[sparse.csr_array, np.ndarray]:
        rhs = np.concatenate(self.rhs) if self.rhs else np.zeros(0)
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0))
        A = sparse.coo_array((cat(self.data), (cat(self.row).astype(int), cat(self.col).astype(int))), shape=(len(rhs), self.width))
        return A.tocsr(), rhs


def _selected(coo: sparse.coo_array, keep: np.ndarray, col_of: np.ndarray, scale: float = 1.0) -> tuple:
    """The entries of ``coo``'s kept rows, renumbered, their columns mapped by ``col_of``."""
    sel = keep[coo.row]
    return scale * coo.data[sel], (np.cumsum(keep) - 1)[coo.row[sel]], col_of[coo.col[sel]]


def _memory_rows(rows: _Rows, mems: list[StageMemory], diag: np.ndarray, nv: int, layers: np.ndarray, budget: float,
                 host_budget: float) -> None:
    """Device rows ``live saving c + resident ckpt o - own ckpt (y + z) >= base - budget`` at every backward row that
    can exceed the budget (``y + z``: the prefetch slots, ``simulator.memory.prefetch_slots``); host rows ``-resident
    ckpt o >= host_base - host_budget`` at every forward row that can."""
    for p, sm in enumerate(mems):
        r = sm.bwd_rows
        live = (sm.live[r] * sm.saving[None, :]).tocoo()
        res = (sm.resident[r] * sm.ckpt[None, :]).tocoo()
        n = len(sm.ckpt)
        own = sparse.csr_array((sm.ckpt, (sm.own_row, np.arange(n))), shape=(len(sm.base), n))[r].tocoo()
        need = sm.base[r] - budget
        growth = np.bincount(live.row, weights=np.maximum(-live.data, 0.0), minlength=len(r)) * layers[p]
        keep = need + growth + 2 * np.bincount(own.row, weights=own.data, minlength=len(r)) > 0
        if keep.any():
            rows.add(need[keep], _selected(live, keep, diag[p]), _selected(res, keep, nv + diag[p]),
                     _selected(own, keep, 2 * nv + diag[p], -1.0), _selected(own, keep, 3 * nv + diag[p], -1.0))
        f = sm.fwd_rows
        host = (sm.resident[f] * sm.ckpt[None, :]).tocoo()
        hneed = sm.host_base[f] - host_budget
        hkeep = hneed + np.bincount(host.row, weights=host.data, minlength=len(f)) * layers[p] > 0
        if hkeep.any():
            rows.add(-hneed[hkeep], _selected(host, hkeep, nv + diag[p], -1.0))


@dataclass
class _OffloadProgram:
    """``A x >= rhs``, ``lb <= x <= ub`` over ``x = [c, o, y, z, e]``: per diagonal the checkpointed layers ``c``, the
    offloaded checkpoints ``o``, whether any is offloaded ``y`` (``o <= c``, ``o <= ub y``) and whether all of at least
    two are (``z``: a second prefetch slot, forced where ``o = c >= 2`` by ``ub z - ub y + (ub - 1) c - ub o >= -ub - 1``;
    ``ub``: the diagonal's most layers); the exposed copy time
    ``e`` of each (stage, chunk, phase) whose copies may not hide (``e_rows``: the rows that bound it). ``cost``: the
    recompute and exposed ms; ``tie``: a millionth of each offloaded byte's copy time (no offload that gains nothing)."""

    A: sparse.csr_array
    rhs: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    cost: np.ndarray
    tie: np.ndarray
    diag: np.ndarray
    nv: int
    e_rows: list[list[int]]


def _copy_rows(rows: _Rows, s: OffloadSetting, ckpt: np.ndarray, diag: np.ndarray, nv: int, ub: np.ndarray,
               rc_layer: np.ndarray) -> tuple[list, list]:
    """The exposed-copy variables (lower bounds) and their rows (:mod:`~megatron_epp.simulator.offload`'s model): per
    (stage, chunk) whose copies can exceed the phase's compute at the most offload, ``e_f >= (o ckpt + out) / d2h - fwd``
    (``>= in / h2d - fwd``: its lower bound); ``e_b + rc c >= (o ckpt + in) / h2d - bwd`` and ``>= out / d2h - bwd``."""
    out_bw, in_bw = s.host.d2h_bytes_per_ms, s.host.h2d_bytes_per_ms
    lbs, e_rows = [], []
    P, n = s.fwd.shape
    for p in range(P):
        for k in range(n):
            d, ck = diag[p, k], ckpt[k]
            most_o = ub[d] * ck
            kv = s.kv
            if max((most_o + kv.fwd_out[p, k]) / out_bw, kv.fwd_in[p, k] / in_bw) > s.fwd[p, k]:
                v = 4 * nv + len(lbs)
                lbs.append(max(0.0, kv.fwd_in[p, k] / in_bw - s.fwd[p, k]))
                first = sum(len(r) for r in rows.rhs)
                rows.add([kv.fwd_out[p, k] / out_bw - s.fwd[p, k]], ([1.0, -ck / out_bw], [0, 0], [v, nv + d]))
                e_rows.append([first])
            if max((most_o + kv.bwd_in[p, k]) / in_bw, kv.bwd_out[p, k] / out_bw) > s.bwd[p, k]:
                v = 4 * nv + len(lbs)
                lbs.append(0.0)
                first = sum(len(r) for r in rows.rhs)
                rows.add([kv.bwd_in[p, k] / in_bw - s.bwd[p, k], kv.bwd_out[p, k] / out_bw - s.bwd[p, k]],
                         ([1.0, -ck / in_bw, rc_layer[k], 1.0, rc_layer[k]], [0, 0, 0, 1, 1], [v, nv + d, d, v, d]))
                e_rows.append([first, first + 1])
    return lbs, e_rows


def _offload_program(mems: list[StageMemory], rc_layer: np.ndarray, layers: np.ndarray, budget: float, mode: Recompute,
                     s: OffloadSetting) -> _OffloadProgram:
    P, n = len(mems), len(rc_layer)
    diag = np.arange(n)[None, :] - np.arange(P)[:, None] + P - 1
    nv = n + P - 1
    ub_c = np.full(nv, np.inf)
    np.minimum.at(ub_c, diag.ravel(), np.repeat(layers, n).astype(float))
    ub_c = np.where(np.isfinite(ub_c), ub_c, 0.0) * (mode != "none")
    rows = _Rows(0)
    _memory_rows(rows, mems, diag, nv, layers, budget, s.host_budget)
    idx = np.arange(nv)
    rows.add(np.zeros(nv), (np.ones(nv), idx, idx), (-np.ones(nv), idx, nv + idx))  # c - o >= 0
    rows.add(np.zeros(nv), (ub_c, idx, 2 * nv + idx), (-np.ones(nv), idx, nv + idx))  # ub y - o >= 0
    rows.add(-ub_c - 1, (ub_c, idx, 3 * nv + idx), (-ub_c, idx, 2 * nv + idx), (np.maximum(ub_c - 1, 0), idx, idx),
             (-ub_c, idx, nv + idx))  # z = 1 where o = c >= 2
    ckpt = mems[0].ckpt
    lbs, e_rows = _copy_rows(rows, s, ckpt, diag, nv, ub_c, rc_layer)
    rows.width = 4 * nv + len(lbs)
    A, rhs = rows.build()
    c_cost = np.bincount(diag.ravel(), weights=np.tile(rc_layer, P), minlength=nv)
    ckpt_ms = np.bincount(diag.ravel(), weights=np.tile(ckpt, P), minlength=nv) / s.host.d2h_bytes_per_ms
    cost = np.concatenate([c_cost, np.zeros(3 * nv), np.ones(len(lbs))])
    tie = np.concatenate([np.zeros(nv), 1e-6 * ckpt_ms + 1e-9, np.full(2 * nv, 1e-9), np.zeros(len(lbs))])
    lb = np.concatenate([ub_c if mode == "full" else np.zeros(nv), np.zeros(3 * nv), lbs])
    ub = np.concatenate([ub_c, ub_c, (ub_c > 0).astype(float), (ub_c >= 2).astype(float), np.full(len(lbs), np.inf)])
    return _OffloadProgram(A, rhs, lb, ub, cost, tie, diag, nv, e_rows)


def _completed(prog: _OffloadProgram, c: np.ndarray, o: np.ndarray) -> np.ndarray:
    """``x`` with these ``c`` and ``o``, ``y`` where ``o > 0``, ``z`` where ``o = c >= 2``, and every ``e`` at the
    least its rows allow."""
    nv = prog.nv
    x = np.concatenate([c, o, (o > 0).astype(float), ((o == c) & (c >= 2)).astype(float), prog.lb[4 * nv:]])
    x[4 * nv:] = 0.0
    slack = prog.A @ x - prog.rhs
    for j, rs in enumerate(prog.e_rows):
        x[4 * nv + j] = max(prog.lb[4 * nv + j], *(-slack[r] for r in rs))
    return x


def _feasible(prog: _OffloadProgram, x: np.ndarray) -> bool:
    return bool((prog.A @ x >= prog.rhs - 1e-6 * np.maximum(np.abs(prog.rhs), 1.0)).all() and (x <= prog.ub + 1e-9).all()
                and (x >= prog.lb - 1e-9).all())


def _check_least(mems: list[StageMemory], layers: np.ndarray, budget: float, mode: Recompute, s: OffloadSetting) -> None:
    """MemoryInfeasible where a stage exceeds the device budget even with every checkpoint it may take offloaded, or
    the host budget with its K/V buffers on the host alone."""
    for p, sm in enumerate(mems):
        most = np.zeros(len(sm.ckpt)) if mode == "none" else np.full(len(sm.ckpt), float(layers[p]))
        worst = sm.during(most, most).max()
        if worst > budget:
            raise MemoryInfeasible(p, worst, budget)
        host = sm.host_base.max(initial=0.0)
        if host > s.host_budget:
            raise HostMemoryInfeasible(p, host, s.host_budget)


def solve_offload(mems: list[StageMemory], rc_layer: np.ndarray, layers: np.ndarray, budget: float, mode: Recompute,
                  time_limit: float, mip_rel_gap: float, s: OffloadSetting) -> RecomputeResult:
    """Keep, recompute or offload: per (stage, chunk) on the anti-diagonal tie, ``c`` checkpointed layers of which ``o``
    keep their checkpoint on the host, minimising the recompute time plus the copy time no compute hides, under the
    device budget at every backward row and the host budget at every forward row (docs/planner.md, "Activation
    offload"). Incumbents: the recompute-only greedy answer (nothing offloaded) and every checkpoint offloaded at full
    recompute; ``adaptive`` also solves the integer program (HiGHS, the same limits) and keeps the best that fits."""
    _check_least(mems, layers, budget, mode, s)
    prog = _offload_program(mems, rc_layer, layers, budget, mode, s)
    nv, ub_c = prog.nv, prog.ub[: prog.nv]
    rprog = _program(mems, rc_layer, layers, budget)
    c_rc = ub_c.copy() if mode == "full" else np.zeros(nv) if mode == "none" or not len(rprog.rhs) else np.minimum(_greedy(rprog), ub_c)
    found = [(x, m) for x, m in ((_completed(prog, c_rc, np.zeros(nv)), "greedy"), (_completed(prog, ub_c, ub_c), "offload-all"))
             if _feasible(prog, x)]
    objective = prog.cost + prog.tie
    lower = None
    if mode == "adaptive":
        scale = np.maximum(np.abs(prog.rhs), 1.0)
        norm = max(objective.max(), 1e-12)
        res = milp(objective / norm, integrality=np.r_[np.ones(4 * nv), np.zeros(len(prog.lb) - 4 * nv)],
                   bounds=Bounds(prog.lb, prog.ub), constraints=LinearConstraint(sparse.diags_array(1.0 / scale) @ prog.A, lb=prog.rhs / scale - 1e-9),
                   options={**ilp_limits(prog, time_limit), "mip_rel_gap": mip_rel_gap})
        if res.x is not None:
            x = _completed(prog, np.round(res.x[:nv]), np.round(res.x[nv: 2 * nv]))
            if _feasible(prog, x):
                found.append((x, "milp"))
            if getattr(res, "mip_dual_bound", None) is not None:
                lower = float(res.mip_dual_bound) * norm
    if not found:
        worst = max(range(len(mems)), key=lambda p: mems[p].host_rows(np.full(len(mems[p].ckpt), float(layers[p]))).max(initial=0.0))
        need = mems[worst].host_rows(np.full(len(mems[worst].ckpt), float(layers[worst]))).max(initial=0.0)
        raise HostMemoryInfeasible(worst, max(need, s.host_budget * (1 + 1e-9)), s.host_budget)
    x, method = min(found, key=lambda f: float(objective @ f[0]))
    total = float(prog.cost @ x)
    gap = 0.0 if lower is None or total <= 0 else max(0.0, (float(objective @ x) - lower) / float(objective @ x))
    c, o = x[:nv][prog.diag].astype(int), x[nv: 2 * nv][prog.diag].astype(int)
    return RecomputeResult(c.tolist(), total, gap, method, o.tolist(), float(x[4 * nv:].sum()))
