"""FlexSP-style adaptive sequence parallelism (arXiv 2412.01523), for comparison; simulated only.

All ``P * tp`` GPUs of a pipeline replica hold the whole model (ZeRO-3 sharded states, gathers
assumed overlapped) and are cut into sequence-parallel (Ulysses) groups of power-of-two sizes; each
sequence runs on one group. On ``d`` GPUs a sequence's compute is its whole-model time at ``tp = 1``
divided by ``d`` plus, per layer, 4 all-to-alls (Q, K, V, output) forward and 4 backward of its
``s / d`` tokens. A group checkpoints every layer if its sequences do not fit otherwise. The MILP
(HiGHS) assigns length buckets to groups to minimise the slowest group, for each layout with at
most two group sizes; the LP relaxation ranks the layouts and the best few are solved exactly.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from megatron_epp.plan import PlanInfeasible
from megatron_epp.cost.features import sequence_features
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.profiles import GIB, analytic_profile


def _layouts(n: int) -> list[list[int]]:
    """Group sizes (powers of two) covering ``n`` GPUs with at most two distinct sizes."""
    sizes = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    out = set()
    for d1 in sizes:
        for d2 in sizes:
            if d2 > d1:
                continue
            for n1 in range(1, n // d1 + 1):
                rest = n - n1 * d1
                if rest % d2 == 0 and (rest == 0 or d2 < d1):
                    out.add(tuple([d1] * n1 + [d2] * (rest // d2)))
    return [list(x) for x in sorted(out)]


def plan_flexsp(lengths: Sequence[int], cost_model: CostModel, memory_gb: float, num_buckets: int = 16, time_limit: float = 0.5) -> dict[str, Any]:
    """Predicted step time and peak memory of FlexSP on the GPUs of one pipeline replica."""
    prof = cost_model.profile
    if prof.tp != 1 and prof.source != "analytic":
        raise ValueError("FlexSP needs the per-GPU (tp=1) costs: a tp=1 or an analytic profile")
    base = prof if prof.tp == 1 else analytic_profile(prof.model, 1)
    shape, m, net = base.model, base.memory, cost_model.network
    n_gpu = cost_model.num_stages * prof.tp
    L = np.sort(np.asarray(lengths, dtype=float))
    edges = np.unique(np.quantile(np.log(L), np.linspace(0, 1, num_buckets + 1)))
    bucket = np.clip(np.searchsorted(edges, np.log(L), side="right") - 1, 0, len(edges) - 2)
    feats = sequence_features(L)
    layers = shape.num_layers
    fb = feats @ ((base.fwd.vector() + base.bwd.vector()) * layers + base.head_fwd.vector() + base.head_bwd.vector())
    rc = feats @ base.recompute.vector() * layers
    params = shape.params_per_layer() * layers + 2 * shape.vocab * shape.hidden
    state_bytes = params * (m.weight + m.grad + m.optim) / n_gpu
    free = memory_gb * GIB - state_bytes
    sizes = [1 << i for i in range(n_gpu.bit_length()) if (1 << i) <= n_gpu]
    kv_frac = shape.kv_hidden / shape.hidden
    time_d = np.full((len(L), len(sizes)), np.inf)
    mem_d = np.zeros((len(L), len(sizes)))
    for j, d in enumerate(sizes):
        act = (m.act_token * L / d + m.act_area * L * L / d) * layers + m.logits_token * L / d
        ckpt = m.ckpt_token * L / d * layers + (m.act_token * L / d + m.act_area * L * L / d) + m.logits_token * L / d
        a2a = 2 * layers * sum(net.alltoall_ms(m.p2p_token * f * L / d, d) for f in (1.0, kv_frac, kv_frac, 1.0))
        t = fb / d + a2a
        time_d[:, j] = np.where(act <= free, t, np.where(ckpt <= free, t + rc / d, np.inf))
        mem_d[:, j] = np.where(act <= free, act, ckpt)
    B = len(edges) - 1
    counts = np.bincount(bucket, minlength=B)
    tb = np.array([[time_d[bucket == b, j].mean() if counts[b] else 0.0 for j in range(len(sizes))] for b in range(B)])
    best: dict[str, Any] | None = None
    ranked = []
    for layout in _layouts(n_gpu):
        prob = _assignment(layout, sizes, tb, counts)
        if prob is None:
            continue
        lp = milp(prob[0], constraints=prob[1], bounds=prob[2])
        if lp.x is not None:
            ranked.append((lp.fun, layout, prob))
    for _, layout, prob in sorted(ranked, key=lambda r: r[0])[:3]:
        res = milp(prob[0], constraints=prob[1], bounds=prob[2], integrality=prob[3], options={"time_limit": time_limit})
        if res.x is not None and (best is None or res.fun < best["predicted_step_ms"]):
            G = len(layout)
            x = np.round(res.x[:-1]).reshape(len(counts), G)
            used = [sizes.index(d) for d in layout]
            peak = max((mem_d[bucket == b][:, used[g]].max() for b in range(B) for g in range(G) if x[b, g] > 0), default=0.0)
            best = {"predicted_step_ms": float(res.fun), "peak_memory_gb": [float((peak + state_bytes) / GIB)], "sp_groups": layout, "mip_gap": float(res.mip_gap or 0.0)}
    if best is None:
        raise PlanInfeasible(f"no sequence-parallel layout fits {memory_gb} GB per GPU")
    return best


def _assignment(layout: list[int], sizes: list[int], tb: np.ndarray, counts: np.ndarray):
    """MILP ``min z``: ``x[b, g]`` sequences of bucket ``b`` on group ``g``; every group's time <= z."""
    B, G = tb.shape[0], len(layout)
    t = tb[:, [sizes.index(d) for d in layout]]  # (B, G)
    if any(counts[b] and not np.isfinite(t[b]).any() for b in range(B)):
        return None
    t = np.where(np.isfinite(t), t, 0.0)
    allowed = np.isfinite(tb[:, [sizes.index(d) for d in layout]])
    nv = B * G + 1
    c = np.zeros(nv)
    c[-1] = 1.0
    cover = np.zeros((B, nv))
    for b in range(B):
        cover[b, b * G : (b + 1) * G] = 1.0
    load = np.zeros((G, nv))
    for g in range(G):
        load[g, g : B * G : G] = t[:, g]
        load[g, -1] = -1.0
    ub = np.append(np.where(allowed, counts[:, None], 0).ravel().astype(float), np.inf)
    cons = [LinearConstraint(cover, counts, counts), LinearConstraint(load, -np.inf, 0.0)]
    integrality = np.append(np.ones(B * G), 0)
    return c, cons, Bounds(0, ub), integrality
