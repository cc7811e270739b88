"""FlexSP (arXiv 2412.01523): adaptive sequence parallelism with ZeRO-3, simulated on the real lengths.

All ``N`` GPUs hold the model as one ZeRO-3 group (bf16 weights, fp32 gradients and Adam states
sharded ``N`` ways) and run at tensor parallel size 1. One step:

1. *Micro-batches* (FlexSP's sequence blaster): the batch is dealt, longest first, onto ``M``
   micro-batches (each sequence to the one with the fewest tokens), ``M`` the least whose token
   share can fit the GPUs' free memory; if a micro-batch then has no feasible assignment, ``M + 1``.
2. *Groups* per micro-batch (FlexSP's MILP, HiGHS): the sequences are bucketed by length (quantiles
   of the log length, ``num_buckets``) and each bucket costed at its *upper* limit, as FlexSP does; the
   MILP opens sequence-parallel (Ulysses) groups of any power-of-two size (up to ``N / d`` groups of
   size ``d``, any mix, at most ``N`` GPUs) and assigns bucket counts to groups, minimising the slowest
   group, with every group's memory for *all* its sequences at once within the budget.
3. *Time on the real lengths*: each bucket's real sequences go onto the groups the MILP gave it
   (longest first onto the least-loaded group with a free slot); a group runs its sequences packed
   in one pass: per layer the tp = 1 compute of every sequence divided by ``d``, 4 all-to-alls
   forward and 4 backward (and 4 more in a recompute) of its ``tokens / d`` per GPU (a group over 8
   GPUs: the intra-node share at NVLink speed, the rest on InfiniBand, :meth:`Network.alltoall_ms`),
   the per-layer launch constants once. A micro-batch takes its slowest group; it also pays ZeRO-3's
   parameter all-gather in the forward, again in the backward (and in a recompute) and the gradient
   reduce-scatter (bf16), over all ``N`` GPUs, of which :func:`exposed_ms` is not hidden behind
   the micro-batch's compute. The step is the sum over micro-batches.
4. *Recompute*: none, or full checkpointing of every layer (a group then keeps each layer's input
   plus one layer's full activations), for the whole step; the faster that fits is taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from megatron_epp.plan import PlanInfeasible
from megatron_epp.cost.clusters import A800, COMM_OVERLAP, H100_SXM, Cluster, exposed_ms
from megatron_epp.cost.features import F, sequence_features
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.network import Network
from megatron_epp.base.units import GIB
from megatron_epp.cost.activation_memory import shape_memory
from megatron_epp.cost.analytic import H100, Accelerator, analytic_profile, shape_time
from megatron_epp.cost.profile import Profile

A2A_PER_LAYER = 4  # Q, K, V, output: forward; the same again in backward and in a recompute
MIP_GAP = 0.02  # FlexSP's MILP is solved to this relative gap (or its time limit)
FILL = 0.9  # the share of the GPUs' free memory the first micro-batch count assumes usable


@dataclass(frozen=True)
class FlexSPCosts:
    """Per-sequence terms of one model on tp = 1 (ms, bytes per GPU of a 1-GPU group)."""

    work: np.ndarray  # (n,) forward + backward compute of the whole model, no per-pass constants
    rc: np.ndarray  # (n,) a full recompute's compute
    mem: dict[str, np.ndarray]  # recompute mode -> (n,) activation bytes held on a 1-GPU group
    a2a_bytes: np.ndarray  # (n,) bytes of one all-to-all per GPU on a 1-GPU group
    pass_ms: float  # per-layer launch constants of one forward + backward pass
    rc_pass_ms: float
    layers: int


def sequence_costs(base: Profile, lengths: np.ndarray) -> FlexSPCosts:
    shape, m = base.model, base.memory
    L = shape.num_layers
    feats = sequence_features(lengths)
    feats[:, [F.SEGMENTS, F.CHUNKS]] = 0.0  # constants per pass, counted once per group
    fb = (base.fwd.vector() + base.bwd.vector()) * L + base.head_fwd.vector() + base.head_bwd.vector()
    s = np.asarray(lengths, dtype=float)
    act = m.act_token * s + m.act_area * s * s  # one layer, all its tokens
    mem = {
        "none": act * L + m.logits_token * s,
        "full": m.ckpt_token * s * L + act + m.logits_token * s,
    }
    return FlexSPCosts(
        work=feats @ fb, rc=feats @ base.recompute.vector() * L, mem=mem,
        a2a_bytes=2.0 * (2 * shape.hidden + 2 * shape.kv_hidden) * s if base.source == "analytic" else m.p2p_token * s * (2 + 2 * shape.kv_hidden / shape.hidden),
        pass_ms=L * (base.fwd.b1 + base.bwd.b1 + base.fwd.bs + base.bwd.bs), rc_pass_ms=L * (base.recompute.b1 + base.recompute.bs), layers=L,
    )


def model_state_bytes(shape, n_gpu: int) -> float:
    """ZeRO-3 per GPU: bf16 weights, fp32 gradients, fp32 Adam (master, m, v) sharded ``n_gpu`` ways,
    plus two gathered layers of bf16 weights, one layer's gradients and the gathered embedding/head."""
    p_layer = shape.params_per_layer()
    params = p_layer * shape.num_layers + 2 * shape.vocab * shape.hidden
    return params * (2 + 4 + 12) / n_gpu + (2 * 2 + 4) * p_layer + 2 * 2 * shape.vocab * shape.hidden


def group_time(c: FlexSPCosts, idx: np.ndarray, d: int, net: Network, mode: str) -> float:
    """One group of ``d`` GPUs running sequences ``idx`` at once (module docstring, 3)."""
    if len(idx) == 0:
        return 0.0
    a2a_calls = A2A_PER_LAYER * c.layers * (3 if mode == "full" else 2)
    compute = (c.work[idx].sum() + (c.rc[idx].sum() if mode == "full" else 0.0)) / d
    consts = c.pass_ms + (c.rc_pass_ms if mode == "full" else 0.0)
    return float(compute + consts + a2a_calls * net.alltoall_ms(c.a2a_bytes[idx].sum() / d, d))


def zero3_ms(shape, n_gpu: int, fabric: Cluster | Network, mode: str) -> float:
    """ZeRO-3 collectives of one micro-batch: parameter all-gathers (forward, backward, recompute) and
    the gradient reduce-scatter, bf16, over all ``n_gpu`` GPUs."""
    params = shape.params_per_layer() * shape.num_layers + 2 * shape.vocab * shape.hidden
    gathers = 3 if mode == "full" else 2
    return (gathers + 1) * _allgather_ms(fabric, 2.0 * params, n_gpu)


def _allgather_ms(fabric: Cluster | Network, nbytes: float, group: int) -> float:
    if isinstance(fabric, Cluster):
        return fabric.allgather_ms(nbytes, group)
    # a bare Network (epp-plan's presets): ring at the slower of NVLink and the node's all-to-all share
    if group <= 1:
        return 0.0
    bw = fabric.nvlink_gbps if group <= fabric.gpus_per_node else min(fabric.nvlink_gbps, fabric.gpus_per_node * fabric.a2a_gbps)
    return nbytes * (group - 1) / group / (bw * 1e6)


def _buckets(lengths: np.ndarray, num_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """Bucket of each sequence (quantiles of log length) and each bucket's upper limit."""
    logl = np.log(lengths)
    edges = np.unique(np.quantile(logl, np.linspace(0, 1, num_buckets + 1)))
    if len(edges) == 1:
        return np.zeros(len(lengths), dtype=int), np.array([lengths.max()])
    b = np.clip(np.searchsorted(edges, logl, side="left") - 1, 0, len(edges) - 2)
    upper = np.array([lengths[b == k].max() if (b == k).any() else 0 for k in range(len(edges) - 1)])
    keep = np.flatnonzero(upper > 0)
    remap = -np.ones(len(upper), dtype=int)
    remap[keep] = np.arange(len(keep))
    return remap[b], upper[keep]


def assign_microbatch(lengths: np.ndarray, base: Profile, n_gpu: int, net: Network, free: float, mode: str,
                      num_buckets: int, time_limit: float) -> list[tuple[int, np.ndarray]] | None:
    """FlexSP's MILP for one micro-batch: ``[(group size, positions into lengths)]``, or None when no
    assignment fits.

    Over the bucket counts (each bucket costed at its upper limit), HiGHS chooses how many groups of
    each power-of-two size to open (``n_d``, any mix, at most ``N`` GPUs) and how many sequences of
    each bucket go to groups of each size (``x[b, d]``), minimising ``z`` with every size class's mean
    group time ``<= z`` (``sum_b T[b, d] x[b, d] + K_d n_d <= z n_d``), no sequence alone slower than
    ``z``, and the class's memory within its ``n_d`` groups' budgets, no sequence over one group's
    budget: for a fixed ``z`` these constraints are linear, so ``z`` is found by bisection over small
    feasibility MILPs (:func:`_bisect_groups`; deterministic, each solved to optimality). The real
    sequences of each bucket then go, longest first, to the classes the MILP gave it (largest groups
    first) and, inside a class, onto the least-loaded group whose memory still holds them; if none
    does, the micro-batch does not fit."""
    bucket, upper = _buckets(lengths, num_buckets)
    B = len(upper)
    counts = np.bincount(bucket, minlength=B).astype(float)
    c = sequence_costs(base, lengths)
    cu = sequence_costs(base, upper.astype(float))
    sizes = [1 << i for i in range(n_gpu.bit_length()) if (1 << i) <= n_gpu]
    S = len(sizes)
    d = np.array(sizes, dtype=float)
    a2a_calls = A2A_PER_LAYER * c.layers * (3 if mode == "full" else 2)
    per_seq = cu.work + (cu.rc if mode == "full" else 0.0)
    # T[b, s]: one upper-limit sequence of bucket b on a group of size d_s; K_s: the group's per-pass constants
    T = per_seq[:, None] / d[None, :] + a2a_calls * np.array(
        [[net.alltoall_ms(cu.a2a_bytes[b] / ds, int(ds)) - _lat(net, int(ds)) for ds in d] for b in range(B)])
    K = c.pass_ms + (c.rc_pass_ms if mode == "full" else 0.0) + a2a_calls * np.array([_lat(net, int(ds)) for ds in d])
    Mem = cu.mem[mode][:, None] / d[None, :]
    allowed = Mem <= free
    if any(counts[b] and not allowed[b].any() for b in range(B)):
        return None
    # the same terms on the real lengths, for the placement
    real = (c.work + (c.rc if mode == "full" else 0.0))[:, None] / d[None, :] + a2a_calls * np.array(
        [[net.alltoall_ms(c.a2a_bytes[i] / ds, int(ds)) - _lat(net, int(ds)) for ds in d] for i in range(len(lengths))])

    def place(x: np.ndarray, n: np.ndarray):
        """The real sequences onto ``n[s]`` groups of each size as ``x`` says; ``(groups, slowest)``."""
        groups: list[tuple[int, list[int]]] = [(sizes[s], []) for s in reversed(range(S)) for _ in range(n[s])]
        size_of = [sizes.index(dg) for dg, _ in groups]
        load = np.array([K[s] for s in size_of])
        mem = np.zeros(len(groups))
        for b in range(B):
            idx = np.flatnonzero(bucket == b)
            idx = idx[np.argsort(-lengths[idx], kind="stable")]
            classes = [s for s in reversed(range(S)) for _ in range(int(x[b, s]))]
            for i, s in zip(idx, classes):
                fits = [g for g in range(len(groups)) if size_of[g] == s and mem[g] + c.mem[mode][i] / sizes[s] <= free]
                if not fits:
                    return None
                g = min(fits, key=lambda g: load[g])
                groups[g][1].append(int(i))
                load[g] += real[i, s]
                mem[g] += c.mem[mode][i] / sizes[s]
        return [(dg, np.array(m, dtype=int)) for dg, m in groups if m], float(max(load[g] for g in range(len(groups)) if groups[g][1]))

    return _bisect_groups(T, K, Mem, allowed, counts, sizes, n_gpu, free, time_limit, place)


def _lat(net: Network, d: int) -> float:
    return net.alltoall_ms(0.0, d)


def simulate_flexsp(lengths: Sequence[int], base: Profile, n_gpu: int, fabric: Cluster | Network, budget_bytes: float, *,
                    overlap: float = COMM_OVERLAP, num_buckets: int = 16, time_limit: float = 0.3,
                    modes: Sequence[str] = ("none", "full")) -> dict[str, Any]:
    """Predicted step of FlexSP on ``n_gpu`` GPUs (``base``: the tp = 1 per-GPU profile)."""
    if base.tp != 1:
        raise ValueError("FlexSP runs at tensor parallel size 1: give a tp = 1 profile")
    base = shape_time(shape_memory(base))
    net = fabric.network(fabric.world_size) if isinstance(fabric, Cluster) else fabric
    L = np.asarray(lengths, dtype=float)
    states = model_state_bytes(base.model, n_gpu)
    free = budget_bytes - states
    if free <= 0:
        raise PlanInfeasible(f"FlexSP: ZeRO-3 model states take {states / GIB:.1f} of {budget_bytes / GIB} GB per GPU")
    c = sequence_costs(base, L)
    best: dict[str, Any] | None = None
    for mode in modes:
        per_token_mem = c.mem[mode]
        if per_token_mem.max() / n_gpu > free:
            continue
        m_min = max(1, math.ceil(per_token_mem.sum() / (n_gpu * free * FILL)))
        for m in range(m_min, len(L) + 1):  # the fewest micro-batches that fit (each pays the ZeRO-3 collectives)
            result = _step(L, c, base, n_gpu, fabric, net, free, mode, m, overlap, num_buckets, time_limit)
            if result is not None:
                if best is None or result["predicted_step_ms"] < best["predicted_step_ms"]:
                    best = {**result, "peak_memory_bytes": [result.pop("peak_act") + states]}
                break
    if best is None:
        raise PlanInfeasible(f"FlexSP: no sequence-parallel assignment fits {budget_bytes / GIB} GB per GPU")
    return best


def _step(L, c, base, n_gpu, fabric, net, free, mode, m, overlap, num_buckets, time_limit):
    """The step with ``m`` micro-batches, or None when one of them has no feasible assignment."""
    loads = np.zeros(m)
    owner = np.empty(len(L), dtype=int)
    for i in np.argsort(-L, kind="stable"):
        k = int(np.argmin(loads))
        owner[i] = k
        loads[k] += L[i]
    total, zero_total, peak, layouts, recompute_ms = 0.0, 0.0, 0.0, [], 0.0
    for k in range(m):
        idx = np.flatnonzero(owner == k)
        groups = assign_microbatch(L[idx], base, n_gpu, net, free, mode, num_buckets, time_limit)
        if groups is None:
            return None
        groups = [(d, idx[g]) for d, g in groups]
        compute = max(group_time(c, g, d, net, mode) for d, g in groups)
        zero = exposed_ms(zero3_ms(base.model, n_gpu, fabric, mode), compute, overlap)
        total += compute + zero
        zero_total += zero
        peak = max(peak, max(c.mem[mode][g].sum() / d for d, g in groups))
        layouts.append(sorted((d for d, _ in groups), reverse=True))
        if mode == "full":
            recompute_ms += max(c.rc[g].sum() / d for d, g in groups)
    return {"predicted_step_ms": total, "peak_act": peak, "micro_batches": m, "sp_groups": layouts, "recompute": mode,
            "zero3_exposed_ms": zero_total, "recompute_ms": recompute_ms}


def check_flexsp_profile(prof: Profile) -> None:
    """FlexSP plans each GPU on its own (sequence parallelism, no TP): it needs per-GPU (tp = 1) costs, which a tp = 1
    profile has and an analytic one is rebuilt with; a ``ValueError`` otherwise."""
    if prof.tp != 1 and prof.source != "analytic":
        raise ValueError(f"FlexSP needs the per-GPU (tp=1) costs, and this {prof.source} profile is for tp={prof.tp}: "
                         "a tp=1 or an analytic profile")


def plan_flexsp(lengths: Sequence[int], cost_model: CostModel, budget_bytes: float, **kw: Any) -> dict[str, Any]:
    """FlexSP on the GPUs of one pipeline replica of ``cost_model`` (``num_stages * tp``), on its network
    and device (an analytic profile is rebuilt at tp = 1; a measured profile must be tp = 1)."""
    prof = cost_model.profile
    check_flexsp_profile(prof)
    base = prof if prof.tp == 1 else analytic_profile(prof.model, 1, _accelerator_of(prof))
    return simulate_flexsp(lengths, base, cost_model.num_stages * prof.tp, cost_model.network, budget_bytes, **kw)


def _accelerator_of(prof: Profile) -> Accelerator:
    """The accelerator an analytic profile was built for (its device name), H100 by default."""
    return next((acc for acc in (A800, H100_SXM, H100) if prof.device.startswith(acc.name)), H100)


def _bisect_groups(T: np.ndarray, K: np.ndarray, Mem: np.ndarray, allowed: np.ndarray, counts: np.ndarray, sizes: list[int],
                   n_gpu: int, free: float, time_limit: float, place, rel_tol: float = MIP_GAP / 4):
    """The least ``z`` (to ``rel_tol``) for which an assignment exists: bisection over ``z``, each step a
    small feasibility MILP (HiGHS) in ``x[b, s]`` (sequences of bucket ``b`` on groups of size ``s``)
    and ``n[s]`` (groups of size ``s``): ``sum_b T x + K n <= z n`` per size, a sequence alone no slower
    than ``z`` (``x[b, s] = 0`` where ``T[b, s] > z``), ``sum_b Mem x <= free n``, ``sum_s d_s n_s <= N``.
    A ``z`` counts as feasible only if ``place(x, n)`` puts the real sequences on the groups with the
    slowest group within ``z`` (the class means of the MILP say nothing of single groups). Returns the
    placement of the least feasible ``z`` found, or None."""
    B, S = T.shape
    d = np.array(sizes, dtype=float)
    nv = B * S + S
    # rows: B covers; per size: time, memory, and two packing cuts (an item over (z - K)/2 fills a group
    # alone, items over (z - K)/3 go at most two to a group); the GPU count
    A = np.zeros((B + 4 * S + 1, nv))
    for b in range(B):
        A[b, b * S:(b + 1) * S] = 1.0
    for s in range(S):
        A[B + 4 * s + 1, s:B * S:S] = Mem[:, s]
        A[B + 4 * s + 1, B * S + s] = -free
        A[B + 4 * s + 2, B * S + s] = -1.0
        A[B + 4 * s + 3, B * S + s] = -2.0
    A[-1, B * S:] = d
    lo_b = np.concatenate([counts, np.repeat([-np.inf], 4 * S), [1.0]])
    hi_b = np.concatenate([counts, np.zeros(4 * S), [float(n_gpu)]])
    integrality = np.ones(nv)
    cost = np.concatenate([np.zeros(B * S), -d])  # among the feasible, the most GPUs (more groups to spread the real lengths)
    best: list = [None]  # the placement with the fastest slowest group seen at any z

    def feasible(z: float):
        for s in range(S):
            A[B + 4 * s, :] = 0.0
            A[B + 4 * s, s:B * S:S] = T[:, s]
            A[B + 4 * s, B * S + s] = K[s] - z
            A[B + 4 * s + 2, s:B * S:S] = T[:, s] > (z - K[s]) / 2
            A[B + 4 * s + 3, s:B * S:S] = T[:, s] > (z - K[s]) / 3
        ok = allowed & (T + K[None, :] <= z)
        if any(counts[b] and not ok[b].any() for b in range(B)):
            return None
        ub = np.concatenate([np.where(ok, counts[:, None], 0.0).ravel(), [n_gpu // ds for ds in sizes]])
        res = milp(cost, constraints=[LinearConstraint(A, lo_b, hi_b)], bounds=Bounds(0, ub), integrality=integrality,
                   options={"time_limit": time_limit})
        if res.x is None:
            return None
        placed = place(np.round(res.x[:B * S]).reshape(B, S), np.round(res.x[B * S:]).astype(int))
        if placed is not None and (best[0] is None or placed[1] < best[0][1]):
            best[0] = placed
        return placed if placed is not None and placed[1] <= z else None

    finite = np.where(allowed, T * d[None, :], np.inf)
    lo = float((counts * finite.min(axis=1)).sum() / n_gpu)  # all GPUs busy on the cheapest placements
    hi = float((counts[:, None] * np.where(allowed, T, 0.0)).max(axis=1).sum() + K.max())
    hi = max(hi, lo) * 1.001
    found = feasible(hi)
    if found is None:
        return None if best[0] is None else best[0][0]
    hi = found[1]
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        sol = feasible(mid)
        if sol is None:
            lo = mid
        else:
            hi = sol[1]
    return best[0][0]
