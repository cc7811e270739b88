"""The cost model calibrated on measured steps: the speed factor and per-chunk overhead in the cost
model, the fit recovering planted values, and the training driver refitting its planner's model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_epp.cost.features import chunk_features
from megatron_epp.cost.model import CostModel
from megatron_epp.base.units import GIB
from megatron_epp.cost.profile import Profile, StageOverhead
from megatron_epp.cost.profile_lookup import load_profile
from megatron_epp.cost.shape import ModelShape
from megatron_epp.plan import MemoryPrediction, PlannedStep
from megatron_epp.planner import build_plan
from megatron_epp.planner.calibration import ONLINE_PRIOR_WEIGHT, fit_step_model, repredict, simulate_steps
from megatron_epp.simulator import simulate
from megatron_epp.base.dims import ParallelDims
from megatron_epp.planner.config import CALIBRATE_FIRST_STEP, PlannerConfig
from megatron_epp.planner.online import OnlinePlanner


def bare_model() -> CostModel:
    """The test profile on 2 stages without any overhead, on the profile's machine (s = 1)."""
    return CostModel(load_profile("test-model"), 2).calibrated(1.0, StageOverhead())


def varied_plans(cm: CostModel, seed: int) -> list:
    """Plans with few large and many small chunks (packing only, 8 slices, a tight budget)."""
    rng = np.random.default_rng(seed)
    return [build_plan(np.minimum(rng.lognormal(6, 1.2, size=16).astype(int) + 2, 4096), cm, gb * GIB, slice_counts=k).plan
            for gb, k in ((1.0, [1]), (1.0, [8]), (0.05, range(1, 9)), (1.0, [4]), (1.0, range(1, 9)))]


def test_profile_overhead_round_trip_and_default():
    profile = load_profile("test-model")
    d = profile.to_dict()
    d.pop("overhead")
    assert Profile.from_dict(d).overhead == StageOverhead()  # older JSON without the entry
    p = dataclasses.replace(profile, overhead=StageOverhead(1.5, 2.5, {"note": "x"}))
    assert Profile.from_dict(p.to_dict()).overhead == StageOverhead(1.5, 2.5, {"note": "x"})
    assert load_profile("llama-7b").overhead == StageOverhead()  # analytic: none


def test_overhead_is_added_per_chunk_on_every_stage():
    cm = bare_model()
    plan = build_plan([300, 900, 2000, 64, 64], cm, 1.0 * GIB).plan
    feats = chunk_features(plan.chunks())
    base = cm.costs(feats)
    more = cm.calibrated(1.0, StageOverhead(2.0, 3.0)).costs(feats)
    np.testing.assert_allclose(more.fwd - base.fwd, 2.0)
    np.testing.assert_allclose(more.bwd - base.bwd, 3.0)
    np.testing.assert_allclose(more.p2p_ms, base.p2p_ms)


def test_speed_factor_scales_every_time_and_so_the_step():
    """The fit rests on this: a step on a model with speed factor s is s times the step at s = 1."""
    cm = bare_model().calibrated(1.0, StageOverhead(2.0, 3.0))
    fast = cm.calibrated(2.5, StageOverhead(2.0, 3.0))
    plan = build_plan([300, 900, 2000, 64, 64], cm, 0.05 * GIB).plan
    feats = chunk_features(plan.chunks())
    a, b = cm.costs(feats), fast.costs(feats)
    for name in ("fwd", "bwd", "rc_layer", "p2p_ms"):
        np.testing.assert_allclose(getattr(b, name), 2.5 * getattr(a, name))
    np.testing.assert_allclose(b.act_layer, a.act_layer)  # memory does not depend on the machine's speed
    assert simulate(plan, fast).step_ms == pytest.approx(2.5 * simulate(plan, cm).step_ms)
    np.testing.assert_allclose(fast.work_vector(), 2.5 * cm.work_vector())


@pytest.mark.parametrize("true_o", [0.0, 4.0, 20.0])
def test_fit_recovers_a_known_overhead(true_o):
    cm = bare_model()
    plans = varied_plans(cm, 0)
    measured = simulate_steps(plans, cm.calibrated(1.0, StageOverhead(true_o / 2, true_o / 2)))
    fit = fit_step_model(plans, measured, cm, fit_speed=False)
    assert fit.speed_factor == 1.0
    assert fit.overhead_ms == pytest.approx(true_o, abs=0.01)
    assert np.abs(fit.rel_err_after).max() < 1e-3
    assert fit.fwd_ms == pytest.approx(fit.bwd_ms)
    # without a prior the fit does not depend on where it starts: from an overhead of 50 ms
    start = cm.calibrated(1.0, StageOverhead(25.0, 25.0))
    assert fit_step_model(plans, measured, start, fit_speed=False, fwd_share=0.5).overhead_ms == pytest.approx(true_o, abs=0.01)


def test_fit_recovers_a_planted_speed_factor_and_overhead():
    cm = bare_model()
    plans = varied_plans(cm, 1)
    measured = 1.5 * simulate_steps(plans, cm.calibrated(1.0, StageOverhead(3.0, 3.0)))  # 1.5x slower, o = 6 profile ms
    fit = fit_step_model(plans, measured, cm)
    assert fit.speed_factor == pytest.approx(1.5, rel=0.02)
    assert fit.overhead_ms == pytest.approx(6.0, rel=0.05)
    assert np.abs(fit.rel_err_after).max() < 0.01 < np.abs(fit.rel_err_before).min()
    # the fitted model predicts other plans
    others = varied_plans(cm, 2)
    truth = 1.5 * simulate_steps(others, cm.calibrated(1.0, StageOverhead(3.0, 3.0)))
    np.testing.assert_allclose(simulate_steps(others, fit.apply(cm)), truth, rtol=0.01)


def test_one_disturbed_step_does_not_drag_the_fit():
    cm = bare_model()
    plans = varied_plans(cm, 3) + varied_plans(cm, 4)
    measured = 2.0 * simulate_steps(plans, cm.calibrated(1.0, StageOverhead(5.0, 5.0)))
    measured[3] *= 2.5  # another job took the cores during this step
    fit = fit_step_model(plans, measured, cm)
    assert fit.speed_factor == pytest.approx(2.0, rel=0.03)
    assert fit.rel_err_after[3] == pytest.approx(1 / 2.5 - 1, abs=0.03)  # left as an outlier
    assert np.abs(np.delete(fit.rel_err_after, 3)).max() < 0.02  # the other steps still fit (plain least squares: 10 %)


def test_prior_keeps_the_overhead_when_the_steps_cannot_tell_it_from_the_speed():
    """Plans of one shape (8 equal sequences, packed): any o fits them with the right s; the online
    fit keeps the overhead it starts from and gets the speed factor."""
    start = bare_model().calibrated(1.0, StageOverhead(4.0, 4.0))
    plans = [build_plan([500] * 8, start, 1.0 * GIB, slice_counts=[1]).plan for _ in range(4)]
    measured = 3.0 * simulate_steps(plans, start)
    fit = fit_step_model(plans, measured, start, prior_weight=ONLINE_PRIOR_WEIGHT)
    assert fit.overhead_ms == pytest.approx(8.0, rel=1e-3)
    assert fit.speed_factor == pytest.approx(3.0, rel=1e-3)


def test_fit_rejects_bad_input():
    cm = bare_model()
    plans = varied_plans(cm, 0)[:2]
    with pytest.raises(ValueError, match="one measured time per plan: 2 plans, 1 times"):
        fit_step_model(plans, [100.0], cm)
    with pytest.raises(ValueError, match="positive and finite"):
        fit_step_model(plans, [100.0, 0.0], cm)


def test_repredict_moves_a_plan_onto_the_new_calibration():
    cm = bare_model()
    step = build_plan([300, 900, 2000, 64, 64], cm, 0.05 * GIB)
    plan, report = step.plan, step.report
    assert (report.speed_factor, report.stage_overhead_ms) == (1.0, 0.0)
    assert repredict(step, cm) is step  # same calibration: untouched
    new = cm.calibrated(2.0, StageOverhead(1.0, 2.0))
    moved = repredict(step, new)
    assert moved.plan is plan and step.report is report  # a new report beside the same plan; the old one as it was
    assert moved.report.predicted_step_ms == pytest.approx(simulate(plan, new).step_ms) and moved.report.predicted_step_ms > 2 * report.predicted_step_ms
    assert (moved.report.speed_factor, moved.report.stage_overhead_ms) == (2.0, 3.0)
    assert moved.report.bound_step_ms == pytest.approx(new.bound_ms(np.array(plan.seq_lengths)))
    assert moved.report.peak_memory_bytes == report.peak_memory_bytes  # the times only
    # what the training step shares over the replica: the plan, its report and the memory prediction, as they were
    shared = dataclasses.replace(moved, memory=MemoryPrediction([1.5e6, 2.5e6], 1.25))
    assert PlannedStep.from_json(shared.to_json()) == shared and PlannedStep.from_json(moved.to_json()) == moved
    assert shared.summary() == plan.summary(report.chosen)


# ----------------------------------------------------------------------------- the training driver's hook
# pretrain_gpt.py's model of ``--pipeline-model-parallel-size 2 --num-layers 4`` (the defaults' hidden 64, 4 heads, a
# 384-token vocabulary) on the CPU profile measured nearest it, with elastic's default slice limit
DRIVER_SHAPE = ModelShape("pretrain_gpt", 4, 64, 4, 256, 384, swiglu=False, tied_embeddings=True)


def plan_builder(calibrate_interval: int, budget_gb: float = 0.05) -> OnlinePlanner:
    config = PlannerConfig(memory_budget_bytes=budget_gb * GIB, max_seq_len=1024, max_slices=8)
    return OnlinePlanner(config, DRIVER_SHAPE, ParallelDims(pp=2), load_profile("test-model"), calibrate_interval=calibrate_interval)


def test_driver_refits_its_planners_model_after_the_first_steps_and_every_interval():
    build = plan_builder(6)  # keeps 6 steps: the warm-up would be among them
    profile_o = build.cost_model.profile.overhead
    machine = build.cost_model.calibrated(1.5, profile_o)  # this machine: 1.5x the profile's, the profile's overhead
    rng = np.random.default_rng(0)
    fits = {}
    for step in range(1, 18):
        plan = build(np.minimum(rng.lognormal(5.5, 1.2, size=16).astype(int) + 2, 1024).tolist()).plan
        fit = build.observe(plan, simulate(plan, machine).step_ms * (3.0 if step == 1 else 1.0))  # a slow warm-up
        if fit is not None:
            fits[step] = fit
            assert build.cost_model.speed_factor == fit.speed_factor
    assert sorted(fits) == [CALIBRATE_FIRST_STEP, CALIBRATE_FIRST_STEP + 6, CALIBRATE_FIRST_STEP + 12]
    assert len(fits[CALIBRATE_FIRST_STEP].rel_err_after) == CALIBRATE_FIRST_STEP - 1  # the warm-up step left out
    assert len(fits[CALIBRATE_FIRST_STEP + 12].rel_err_after) == 6  # the last 6 steps
    for fit in fits.values():
        assert fit.speed_factor == pytest.approx(1.5, rel=0.02)
        assert fit.overhead_ms == pytest.approx(profile_o.fwd_ms + profile_o.bwd_ms, rel=0.02)
    # the plans made after a fit predict this machine
    step = build(np.minimum(rng.lognormal(5.5, 1.2, size=16).astype(int) + 2, 1024).tolist())
    assert step.report.speed_factor == build.cost_model.speed_factor
    assert step.report.predicted_step_ms == pytest.approx(simulate(step.plan, machine).step_ms, rel=0.02)


def test_driver_does_not_calibrate_with_interval_0():
    build = plan_builder(0)
    model = build.cost_model
    plan = build([500] * 16).plan
    assert all(build.observe(plan, 1000.0) is None for _ in range(30))
    assert build.cost_model is model
    # a checkpoint's calibration is not taken either: off means the profile as given
    build.load_state_dict({"steps_observed": 7, "calibration": (2.0, 1.0, 1.0), "next_step_calibration": (2.0, 1.0, 1.0),
                           "measured": []})
    assert build.cost_model is model and build.next_step_model is model


def made(step) -> dict:
    """What a plan is and its report, without how long its search took."""
    return {**step.plan.to_dict(), "report": {**dataclasses.asdict(step.report), "solve_ms": None}}


def test_a_restored_calibration_plans_and_refits_as_the_saved_run():
    """Resume (checkpoint.checkpointing saves ``state_dict`` on every rank): the restored planner holds the saved
    calibration, plans its first two steps as the run did (the first on the model of the fit before the
    checkpoint's: plans are made one step ahead), and its next fit is on the saved spans, at the run's step."""
    interval = 3
    run = plan_builder(interval, budget_gb=0.015)  # memory binds: chunks vary
    o = run.cost_model.profile.overhead
    machine = run.cost_model.calibrated(1.5, StageOverhead(3 * o.fwd_ms, 3 * o.bwd_ms))  # slower, 3x the overhead
    rng = np.random.default_rng(1)
    saved_at = CALIBRATE_FIRST_STEP + interval  # a checkpoint after the second fit
    refit = saved_at + interval
    batches = [np.minimum(rng.lognormal(5.5, 1.2, size=16).astype(int) + 2, 1024).tolist() for _ in range(refit)]
    plans, fits = {(run, 1): run(batches[0]), (run, 2): run(batches[1])}, {}

    def step(build: OnlinePlanner, k: int) -> None:
        """Step ``k`` as the driver runs it: observe, then plan step k + 2 on the model it leaves."""
        fits[build, k] = build.observe(plans[build, k].plan, simulate(plans[build, k].plan, machine).step_ms)
        if k + 2 <= refit:
            plans[build, k + 2] = build(batches[k + 1], build.cost_model)

    for k in range(1, saved_at + 1):
        step(run, k)
    saved = run.state_dict()
    resumed = plan_builder(interval, budget_gb=0.015)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved and saved["steps_observed"] == saved_at
    assert resumed.cost_model.speed_factor == run.cost_model.speed_factor != fits[run, CALIBRATE_FIRST_STEP].speed_factor
    # the step after the checkpoint was planned on the first fit, the one after it on the second
    plans[resumed, saved_at + 1] = resumed(batches[saved_at], resumed.next_step_model)
    plans[resumed, saved_at + 2] = resumed(batches[saved_at + 1], resumed.cost_model)
    for k in (saved_at + 1, saved_at + 2):
        assert made(plans[resumed, k]) == made(plans[run, k]), k
    assert made(plans[run, saved_at + 1]) != made(resumed(batches[saved_at], resumed.cost_model)), \
        "planned on the latest fit, the step's plan would be the same: the test would show nothing"
    # the training's tickets (OnlinePlanner.plan_ahead) make those two plans: the first of the process on the model
    # the checkpoint's next step was planned on, the next on the latest fit
    ticketed = plan_builder(interval, budget_gb=0.015)
    ticketed.load_state_dict(saved)
    tickets = [ticketed.plan_ahead(batches[saved_at]), ticketed.plan_ahead(batches[saved_at + 1])]
    assert tickets[0].cost_model is ticketed.next_step_model and tickets[1].cost_model is ticketed.cost_model
    for k, ticket in zip((saved_at + 1, saved_at + 2), tickets):
        assert ticket.planned.result().step.plan.to_dict()["pipelines"] == plans[run, k].plan.to_dict()["pipelines"], k
    for k in range(saved_at + 1, refit + 1):
        step(run, k)
        step(resumed, k)
    assert [k for (b, k), f in fits.items() if b is resumed and f] == [refit]
    # the first step of the resumed process is a warm-up, left out: the fit is on saved steps and the later ones
    assert len(fits[resumed, refit].rel_err_after) == max(interval, CALIBRATE_FIRST_STEP - 1) == len(fits[run, refit].rel_err_after)
    assert fits[resumed, refit].speed_factor == pytest.approx(fits[run, refit].speed_factor, rel=0.02)


def test_a_ticket_planned_between_steps_is_planned_when_taken_on_the_model_of_that_moment():
    """``--epp-plan-between-steps`` (``plan_ahead(..., background=False)``): no planner thread starts and nothing is
    planned until :meth:`take`, which plans on the cost model as the steps observed since have calibrated it (the
    ticket's model left behind); a background ticket made at the same moment keeps the model it was planned on."""
    build = plan_builder(3, budget_gb=0.015)  # memory binds: chunks vary with the model
    o = build.cost_model.profile.overhead
    machine = build.cost_model.calibrated(1.5, StageOverhead(3 * o.fwd_ms, 3 * o.bwd_ms))
    rng = np.random.default_rng(1)
    batches = [np.minimum(rng.lognormal(5.5, 1.2, size=16).astype(int) + 2, 1024).tolist() for _ in range(CALIBRATE_FIRST_STEP + 8)]
    observed, later = batches[:CALIBRATE_FIRST_STEP], batches[CALIBRATE_FIRST_STEP:]
    for lengths in observed[:-1]:  # up to the step before the first fit
        plan = build(lengths).plan
        build.observe(plan, simulate(plan, machine).step_ms)
    before = build.cost_model
    deferred = [build.plan_ahead(lengths, background=False) for lengths in later]
    assert all(t.planned is None for t in deferred) and build._thread is None, "planned at once, or a thread started"
    background = [build.plan_ahead(lengths) for lengths in later]
    last = build(observed[-1]).plan
    assert build.observe(last, simulate(last, machine).step_ms) is not None  # the first fit: a new model
    assert build.cost_model is not before
    differ = 0
    for lengths, d, b in zip(later, deferred, background, strict=True):
        taken, kept = build.take(d), build.take(b)
        assert taken.cost_model is build.cost_model and kept.cost_model is before
        assert made(taken.step) == made(build(lengths, build.cost_model))
        differ += made(taken.step)["pipelines"] != made(kept.step)["pipelines"]
    assert differ, "the same plans on both models: the test would show nothing"
