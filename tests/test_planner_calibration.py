"""Executor-overhead calibration: the overhead in the cost model, the fit recovering it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_epp.cost.model import CostModel
from megatron_epp.cost.profiles import load_profile
from megatron_epp.planner import build_plan
from megatron_epp.tools.calibration import fit_overhead, simulate_steps, with_overhead
from megatron_epp.cost.features import chunk_features
from megatron_epp.cost.profiles import Profile, StageOverhead


def test_profile_overhead_round_trip_and_default():
    profile = load_profile("test-model")
    d = profile.to_dict()
    d.pop("overhead")
    assert Profile.from_dict(d).overhead == StageOverhead()  # older JSON without the entry
    p = with_overhead(profile, 1.5, 2.5, {"note": "x"})
    assert Profile.from_dict(p.to_dict()).overhead == StageOverhead(1.5, 2.5, {"note": "x"})
    assert load_profile("llama-7b").overhead == StageOverhead()  # analytic: none


def test_overhead_is_added_per_chunk_on_every_stage():
    profile = with_overhead(load_profile("test-model"), 0.0, 0.0)
    plan = build_plan([300, 900, 2000, 64, 64], CostModel(profile, 2), 1.0)
    feats = chunk_features(plan.chunks())
    base = CostModel(profile, 2).costs(feats)
    more = CostModel(with_overhead(profile, 2.0, 3.0), 2).costs(feats)
    np.testing.assert_allclose(more.fwd - base.fwd, 2.0)
    np.testing.assert_allclose(more.bwd - base.bwd, 3.0)
    np.testing.assert_allclose(more.p2p_ms, base.p2p_ms)


@pytest.mark.parametrize("true_o", [0.0, 4.0, 20.0])
def test_fit_recovers_a_known_overhead(true_o):
    profile = with_overhead(load_profile("test-model"), 0.0, 0.0)
    cm = CostModel(profile, 2)
    rng = np.random.default_rng(0)
    plans = []
    for memory_gb, k in ((1.0, range(1, 9)), (0.05, range(1, 9)), (1.0, [1]), (1.0, [8])):
        lengths = np.minimum(rng.lognormal(6, 1.2, size=16).astype(int) + 2, 4096)
        plans.append(build_plan(lengths, cm, memory_gb, slice_counts=k))
    measured = simulate_steps(plans, cm, true_o / 2, true_o / 2)
    fit = fit_overhead(plans, measured, cm)
    assert fit.per_chunk_ms == pytest.approx(true_o, abs=0.01)
    assert np.abs(fit.rel_err_after).max() < 1e-3
    assert fit.fwd_ms == pytest.approx(fit.bwd_ms)
    # the profile's own overhead is ignored by the fit (it starts from zero)
    cm2 = CostModel(dataclasses.replace(profile, overhead=StageOverhead(50.0, 50.0)), 2)
    assert fit_overhead(plans, measured, cm2).per_chunk_ms == pytest.approx(true_o, abs=0.01)


def test_fit_with_slowdown_separates_a_uniformly_slower_machine():
    profile = with_overhead(load_profile("test-model"), 0.0, 0.0)
    cm = CostModel(profile, 2)
    rng = np.random.default_rng(1)
    plans = [build_plan(np.minimum(rng.lognormal(6, 1.2, size=16).astype(int) + 2, 4096), cm, gb, slice_counts=k)
             for gb, k in ((1.0, [1]), (1.0, [8]), (0.05, range(1, 9)), (1.0, [4]))]
    measured = 2.5 * simulate_steps(plans, cm, 3.0, 3.0)  # everything 2.5x slower, o = 6 ms in profile units
    fit = fit_overhead(plans, measured, cm, slowdown=True)
    assert fit.slowdown == pytest.approx(2.5, rel=0.02)
    assert fit.per_chunk_ms == pytest.approx(6.0, rel=0.05)
