"""Property tests: every plan the planners build is executable and fits, per the exact schedule walk."""

from __future__ import annotations


import numpy as np
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from megatron_epp.planner.builders import MEGATRON, SEQ1F1B, plan_batch
from megatron_epp.planner.compare import run_baselines
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.planner.epp import PlanInfeasible, build_plan
from megatron_epp.cost.features import chunk_features
from megatron_epp.cost.model import CostModel
from megatron_epp.simulator.memory import pipeline_memory
from megatron_epp.base.units import GIB
from megatron_epp.cost.profile_lookup import load_profile
from megatron_epp.simulator.step import simulate
from megatron_epp.plan.order import sequence_units

PROFILE = load_profile("test-model")


def check_plan(plan, cost_model: CostModel, budget_gb: float) -> None:
    """Valid, every token exactly once, memory within budget during every op, dependencies kept."""
    plan.validate()
    seen = [np.zeros(n, dtype=int) for n in plan.seq_lengths]
    for c in plan.chunks():
        for s in c.segments:
            seen[s.seq][s.start : s.end] += 1
    assert all((s == 1).all() for s in seen)
    states = cost_model.model_state_bytes()
    for pipe in plan.pipelines:
        mems = pipeline_memory(pipe, cost_model.costs(chunk_features(pipe.chunks)), cost_model.layers, states)
        for p, sm in enumerate(mems):
            assert sm.during(pipe.recompute[p]).max() <= budget_gb * GIB * (1 + 1e-9)
    sim = simulate(plan, cost_model)
    t = {(e.pipeline, e.stage, e.op, e.pos): e for e in sim.events}
    P = plan.num_stages
    for (pi, p, op, k), e in t.items():
        assert e.end >= e.start
        if op == "F" and p > 0:
            assert e.start >= t[pi, p - 1, "F", k].end
        if op == "B":
            assert e.start >= t[pi, p, "F", k].end
            if p < P - 1:
                assert e.start >= t[pi, p + 1, "B", k].end
    for pi, pipe in enumerate(plan.pipelines):
        for unit in sequence_units(pipe):
            for a, b in zip(unit, unit[1:]):  # slice a precedes slice b
                for p in range(P):
                    assert t[pi, p, "F", b].start >= t[pi, p, "F", a].end
                    assert t[pi, p, "B", a].start >= t[pi, p, "B", b].end
    assert sim.step_ms >= max(sim.busy_ms) - 1e-9


batches = st.lists(st.integers(1, 3000), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=batches, stages=st.sampled_from([1, 2, 4]), memory_mb=st.integers(30, 400), mode=st.sampled_from(["adaptive", "greedy", "full"]))
def test_epp_plans_are_valid_and_fit(lengths, stages, memory_mb, mode):
    cm = CostModel(PROFILE, stages)
    try:
        step = build_plan(lengths, cm, memory_mb / 1024 * GIB, recompute=mode)
    except PlanInfeasible:
        assume(False)
    check_plan(step.plan, cm, memory_mb / 1024)
    assert step.report.fits and step.report.predicted_step_ms >= step.report.bound_step_ms * (1 - 1e-9)


@settings(max_examples=30, deadline=None)
@given(lengths=batches, stages=st.sampled_from([2, 4]), memory_mb=st.integers(50, 400))
def test_baseline_plans_are_valid_and_fit(lengths, stages, memory_mb):
    cm = CostModel(PROFILE, stages)
    config = PlannerConfig(memory_mb / 1024 * GIB, 3000, max_slices=4)
    checked = 0
    for builder in (MEGATRON, SEQ1F1B):
        try:
            plan = builder.plan(lengths, cm, config).plan
        except PlanInfeasible:
            continue
        check_plan(plan, cm, memory_mb / 1024)
        checked += 1
    assume(checked)  # a case where no baseline plans checks nothing: one that never plans fails as Unsatisfiable


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=batches, stages=st.sampled_from([2, 4]), memory_mb=st.integers(40, 400))
def test_elastic_never_predicted_slower_than_a_baseline_it_could_make(lengths, stages, memory_mb):
    """The elastic builder weighs Megatron packing and Seq1F1B (k = 2, 4, 8) on the same cost model and
    budget: its plan is never predicted slower than any of them that fits."""
    cm = CostModel(PROFILE, stages)
    config = PlannerConfig(memory_mb / 1024 * GIB, 3000)
    try:
        step = plan_batch(lengths, cm, config)
    except PlanInfeasible:
        assume(False)
    check_plan(step.plan, cm, memory_mb / 1024)
    compared = 0
    for builder in (MEGATRON, *(SEQ1F1B.at(k) for k in (2, 4, 8))):
        try:
            other = builder.plan(lengths, cm, config)
        except PlanInfeasible:
            continue
        assert step.report.predicted_step_ms <= other.report.predicted_step_ms * (1 + 1e-9), (builder.name, step.report.candidates_ms)
        assert builder.plan_name in step.report.candidates_ms
        compared += 1
    assume(compared)  # no baseline fits: nothing compared; baselines that never plan: Unsatisfiable


ABLATIONS_AND_PACKING = ("epp-no-ckpt", "epp-full-ckpt", "epp-no-balance", "megatron", "seq1f1b")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=batches, stages=st.sampled_from([1, 2, 4]), memory_mb=st.integers(40, 400), max_slices=st.sampled_from([None, 4]))
# found 2026-11-29: the no-recompute family's chunking was planned with recompute in one pipeline (1215 ms), where the
# no-recompute ablation regrouped it into two pipelines without any (1206 ms)
@example(lengths=[170, 2831, 2831], stages=1, memory_mb=136, max_slices=None)
def test_epp_never_predicted_slower_than_its_ablations_or_packing_and_never_below_the_bound(lengths, stages, memory_mb, max_slices):
    """On the same cost model and budget, EPP's plan is predicted no slower than each of its ablations
    (without checkpointing, with full checkpointing, without workload balance) and than Megatron
    packing and Seq1F1B; and no plan is predicted faster than the bound."""
    cm = CostModel(PROFILE, stages)
    config = PlannerConfig(memory_mb / 1024 * GIB, 3000, max_slices=max_slices)
    try:
        step = plan_batch(lengths, cm, config)
    except PlanInfeasible:
        assume(False)
    epp, bound = step.report.predicted_step_ms, step.report.bound_step_ms
    assert epp >= bound * (1 - 1e-9)
    compared = 0
    for name, other in run_baselines(lengths, cm, config, ABLATIONS_AND_PACKING).items():
        if other["fits"]:
            assert epp <= other["predicted_step_ms"] * (1 + 1e-9), (name, other["predicted_step_ms"], step.report.candidates_ms)
            assert other["predicted_step_ms"] >= bound * (1 - 1e-9), name
            compared += 1
    assume(compared)  # none fits: nothing compared (rare where EPP fits: 0 of 60 sampled); never any: Unsatisfiable
