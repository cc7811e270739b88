"""The baselines' simulated times against hand computations on small batches, and FlexSP's memory."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_epp.base.dims import ParallelDims
from megatron_epp.cost.clusters import A800, NVLINK_LATENCY_US, Cluster
from megatron_epp.base.units import GIB
from megatron_epp.cost.analytic import analytic_profile
from megatron_epp.cost.shape import ModelShape
from megatron_epp.plan import PlanInfeasible
from megatron_epp.planner.builders import MEGATRON, SEQ1F1B
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.planner.layout import evaluate_layout, layout_cost_model, system_plan
from megatron_epp.simulator.flexsp import A2A_PER_LAYER, assign_microbatch, group_time, model_state_bytes, sequence_costs, simulate_flexsp

SHAPE = ModelShape("toy", 2, 256, 4, 1024, 1000, dtype="bfloat16")
NODE2 = Cluster("toy-node", A800, 80.0, 2, 1, 200.0, 6.25)  # one node of 2 GPUs
BASE = analytic_profile(SHAPE, 1, A800)
L_ = SHAPE.num_layers


def seq_ms(s: float, rc: bool = False) -> float:
    """Forward + backward (+ a recompute) of one whole sequence on one GPU, launch constants apart."""
    f, b, h, hb = BASE.fwd, BASE.bwd, BASE.head_fwd, BASE.head_bwd
    t = L_ * ((f.a1 + b.a1) * s * s + (f.a2 + b.a2) * s) + (h.a2 + hb.a2) * s
    return t + (L_ * (f.a1 * s * s + f.a2 * s) if rc else 0.0)


def chunk_ms(segments: list[tuple[int, int]]) -> float:
    """Forward + backward of one chunk (segments ``(s, C)``) through the whole model on one GPU."""
    f, b, h, hb = BASE.fwd, BASE.bwd, BASE.head_fwd, BASE.head_bwd
    t = sum(L_ * ((f.a1 + b.a1) * s * s + (f.a1c + b.a1c) * s * c + (f.a2 + b.a2) * s) + (h.a2 + hb.a2) * s for s, c in segments)
    return t + L_ * (f.b1 + b.b1)


def params() -> float:
    return SHAPE.params_per_layer() * L_ + 2 * SHAPE.vocab * SHAPE.hidden


def nvlink_gather_ms(nbytes: float, group: int = 2) -> float:
    return NVLINK_LATENCY_US * 1e-3 * (group - 1) + nbytes * (group - 1) / group / (200.0 * 1e6)


def test_flexsp_step_equals_hand_computation():
    out = simulate_flexsp([1000, 1000], BASE, 2, NODE2, 80.0 * GIB, overlap=0.5)
    # two groups of one GPU, one sequence each (a group of 2 would pay all-to-alls for nothing)
    assert out["sp_groups"] == [[1, 1]] and out["micro_batches"] == 1 and out["recompute"] == "none"
    compute = seq_ms(1000) + L_ * (BASE.fwd.b1 + BASE.bwd.b1)
    zero = 3 * nvlink_gather_ms(2.0 * params())  # all-gather forward, again backward, reduce-scatter
    assert out["predicted_step_ms"] == pytest.approx(compute + max(0.5 * zero, zero - compute), rel=1e-9)


def test_flexsp_group_time_pays_all_to_alls_on_the_real_lengths():
    net = NODE2.network(2)
    c = sequence_costs(BASE, np.array([1000.0, 300.0]))
    a2a_bytes = 2.0 * (2 * SHAPE.hidden + 2 * SHAPE.kv_hidden) * 1300 / 2  # per GPU, Q K V O
    a2a = NVLINK_LATENCY_US * 1e-3 + a2a_bytes / 2 / (200.0 * 1e6)
    hand = (seq_ms(1000) + seq_ms(300)) / 2 + L_ * (BASE.fwd.b1 + BASE.bwd.b1) + 2 * A2A_PER_LAYER * L_ * a2a
    assert group_time(c, np.array([0, 1]), 2, net, "none") == pytest.approx(hand, rel=1e-9)
    # full recompute repeats the forward compute and its 4 all-to-alls per layer
    hand_rc = (seq_ms(1000, True) + seq_ms(300, True)) / 2 + L_ * (2 * BASE.fwd.b1 + BASE.bwd.b1) + 3 * A2A_PER_LAYER * L_ * a2a
    assert group_time(c, np.array([0, 1]), 2, net, "full") == pytest.approx(hand_rc, rel=1e-9)


def test_flexsp_memory_per_micro_batch_within_budget():
    lengths = np.array([4000, 3500, 3000, 2500, 2000, 1500, 1200, 800, 500, 300, 200, 100])
    states = model_state_bytes(SHAPE, 2)
    per_token = BASE.memory.act_token * L_ + BASE.memory.logits_token
    budget = states + per_token * lengths.sum() / 2 / 3  # bytes: a third of the batch fits at once
    out = simulate_flexsp(lengths, BASE, 2, NODE2, budget, modes=("none",))
    assert out["micro_batches"] >= 3 and max(out["peak_memory_bytes"]) <= budget
    free = budget - states
    c = sequence_costs(BASE, lengths.astype(float))
    net = NODE2.network(2)
    assert assign_microbatch(lengths[:4].astype(float), BASE, 2, net, free, "none", 16, 1.0) is None  # 13K tokens at once: no
    part = [0, 9, 10, 11]
    groups = assign_microbatch(lengths[part].astype(float), BASE, 2, net, free, "none", 16, 1.0)
    assert groups is not None
    for d, members in groups:
        assert c.mem["none"][np.array(part)[members]].sum() / d <= free
    with pytest.raises(PlanInfeasible, match=r"FlexSP: ZeRO-3 model states take .* GB per GPU"):
        simulate_flexsp(lengths, BASE, 2, NODE2, states * 0.99)  # not even the ZeRO-3 states fit


def test_megatron_layout_step_equals_hand_computation():
    config = PlannerConfig(memory_budget_bytes=80.0 * GIB, max_seq_len=2048)
    res = evaluate_layout(np.array([1000, 600, 300]), SHAPE, NODE2, ParallelDims(tp=1, pp=1, dp=2, cp=1), MEGATRON, config)
    # replicas by work: [1000] and [600, 300] packed into one 2048-token micro-batch; no recompute needed
    per_replica = [chunk_ms([(1000, 0)]), chunk_ms([(600, 0), (300, 0)])]
    sync = 0.5 * (nvlink_gather_ms(4.0 * (params() + SHAPE.norm_params)) + nvlink_gather_ms(2.0 * (params() + SHAPE.norm_params)))
    assert res.sync_ms == pytest.approx(sync, rel=1e-9)
    assert res.step_ms == pytest.approx(max(per_replica) + sync, rel=1e-9)
    assert res.recomputed_layers == 0


def test_seq1f1b_step_equals_hand_computation_and_best_k_is_reported():
    cm = layout_cost_model(SHAPE, NODE2, ParallelDims(tp=1, pp=1, dp=2, cp=1))
    config = PlannerConfig(memory_budget_bytes=80.0 * GIB, max_seq_len=1024, max_slices=2)
    step = SEQ1F1B.plan([1000, 300], cm, config)
    plan = step.plan
    slices = [c for c in plan.chunks() if any(s.seq == 0 for s in c.segments)]
    assert len(slices) == 2  # 1000 > 1024 / 2: two slices of equal work
    hand = sum(chunk_ms([(s.length, s.start) for s in c.segments]) for c in plan.chunks())  # one stage: no overlap
    assert step.report.predicted_step_ms == pytest.approx(hand, rel=1e-9)
    best, k = system_plan(SEQ1F1B, np.array([1000, 300]), cm, PlannerConfig(memory_budget_bytes=80.0 * GIB, max_seq_len=1024))
    each = [SEQ1F1B.at(k).plan([1000, 300], cm, PlannerConfig(80.0 * GIB, 1024)).report.predicted_step_ms for k in (2, 4, 8, 16)]
    assert best.report.predicted_step_ms == min(each) and k == f"k{(2, 4, 8, 16)[int(np.argmin(each))]}"
