"""The per-chunk cost (issue 40, part 3): measured by the start-up profiler, charged by the planner.

* The profiler times the same tokens as one chunk of several documents and as several chunks of one
  (:func:`~megatron_epp.measure.profiling._measure_chunk_cost`); the profile's ``b1`` (layer and head) is that
  measurement, ``a2`` refitted beside it (:func:`~megatron_epp.cost.profile_fit.with_chunk_cost`), not the intercept
  of a line through a few lengths.
* :meth:`Timer.split` sees a per-chunk host cost (the chunk's ``prepare``) as the executor pays it.
* Whatever EPP's own search plans, the elastic builder never takes a plan it predicts slower than Megatron packing's
  on the same cost model and budget: with a large per-chunk constant and a many-chunk plan of its own, it takes
  Megatron packing's, and says so (``report.chosen``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_epp.base.units import GIB
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.profile import TimeCoeffs
from megatron_epp.cost.profile_fit import with_chunk_cost
from megatron_epp import cost
from megatron_epp.cost.profile import Profile
from megatron_epp.measure import profiling
from megatron_epp.measure.layer_bench import init_single_process
from megatron_epp.measure.profiling import ProfileGrid, Timer, measure_profile
from megatron_epp.planner import builders
from megatron_epp.planner.builders import ELASTIC, MEGATRON, SEQ1F1B
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.cost.shape import ModelShape

LLAMA = ModelShape("llama-like", 1, 64, 8, 96, 128, num_kv_heads=2, kv_channels=16, normalization="RMSNorm", bias=False)
GRID = ProfileGrid((16, 32), (0, 16, 32), (16, 64, 128), (16, 64), warmup=0, repeats=1)


def test_the_profiles_per_chunk_constant_is_the_measured_one():
    init_single_process()
    lines: list[str] = []
    profile = measure_profile(LLAMA, torch.device("cpu"), torch.float32, "sdpa-merged", GRID, log=lines.append)
    chunk = profile.fit["chunk_cost"]
    assert chunk["tokens"] == 64 and chunk["chunks"] == profiling.CHUNK_SPLIT  # the grid's second-shortest layer length
    for name in ("fwd", "bwd", "head_fwd", "head_bwd"):
        assert chunk[name] >= 0.0
        assert getattr(profile, name).b1 == chunk[name], name
        assert "b1_fitted" in profile.fit["errors"][name]
    assert any(line.strip().startswith("chunk cost 4 x 16 tokens") for line in lines)


def test_past_the_time_box_the_fitted_intercept_stays(monkeypatch):
    init_single_process()
    monkeypatch.setattr(profiling.Measurement, "late", lambda self, done, needed, what: what.startswith("chunk cost"))
    profile = measure_profile(LLAMA, torch.device("cpu"), torch.float32, "sdpa-merged", GRID, log=lambda line: None)
    assert profile.fit["chunk_cost"] is None
    assert "b1_fitted" not in profile.fit["errors"]["fwd"]


def test_b1_is_the_measurement_and_a2_is_refitted_beside_it():
    n = np.array([1000.0, 4000.0, 8000.0])
    fitted = {"fwd": (TimeCoeffs(1e-8, 2e-8, 1e-3, 0.0, 0.1, 0.05), {}), "head_fwd": (TimeCoeffs(0, 0, 1e-4, 0, 0, 0.0), {})}
    times = {"fwd": 1e-8 * n**2 + 0.1 + 2e-3 * n + 1.5, "head_fwd": 3e-4 * n + 0.7}
    out = with_chunk_cost(fitted, n, times, {"fwd": 1.5, "head_fwd": 0.7})
    assert out["fwd"][0].b1 == 1.5 and out["fwd"][0].a2 == pytest.approx(2e-3)
    assert out["fwd"][0].a1 == 1e-8 and out["fwd"][0].bs == 0.1  # the attention's terms as fitted
    assert out["head_fwd"][0].b1 == 0.7 and out["head_fwd"][0].a2 == pytest.approx(3e-4)
    assert out["fwd"][1]["rms_rel_err"] < 1e-9 and out["fwd"][1]["b1_fitted"] == 0.05


def _busy(ms: float) -> None:
    end = time.process_time() + ms / 1e3
    while time.process_time() < end:
        pass


def test_the_split_sees_a_per_chunk_host_cost():
    timer = Timer(torch.device("cpu"), warmup=0, repeats=3)
    x = torch.ones(8, requires_grad=True)

    def chunks(n: int):
        return [(lambda: _busy(5.0), lambda t: (t * 2).sum(), (x,)) for _ in range(n)]

    fwd, bwd = timer.split(lambda: chunks(1), lambda: chunks(4))
    assert 3 * 5.0 * 0.9 <= fwd <= 3 * 5.0 * 3  # three more prepares of 5 ms, counted in the forward
    assert abs(bwd) < 5.0


@pytest.fixture
def large_chunk_cost() -> CostModel:
    """The shipped H100 profile with 20 ms more per chunk and layer, forward and backward (a launch-bound device)."""
    p = Profile.load(Path(cost.__file__).parent / "profiles" / "gpu-h1024_h100_tp1.json")
    return CostModel(replace(p, fwd=replace(p.fwd, b1=p.fwd.b1 + 20), bwd=replace(p.bwd, b1=p.bwd.b1 + 20)), 1)


def test_the_elastic_builder_never_takes_its_own_plan_where_megatron_packing_is_predicted_faster(monkeypatch, large_chunk_cost):
    """EPP's own search stands in for one that cut the batch into many chunks (Seq1F1B's k = 8 plan, named ``epp``):
    on a cost model with a large per-chunk constant the builder takes Megatron packing's plan (fewer chunks), and
    its report says which; with the comparison undone (EPP's own plan taken) the chosen plan is predicted slower."""
    lengths = [4096, 3000, 1800, 900, 500, 300, 200, 100]
    config = PlannerConfig(80 * GIB, 4096)
    many = SEQ1F1B.at(8).plan(lengths, large_chunk_cost, config)
    monkeypatch.setattr(builders, "build_plan", lambda *a, **k: replace(many, plan=replace(many.plan, builder=ELASTIC.plan_name)))
    step = ELASTIC.plan(lengths, large_chunk_cost, config)
    megatron = MEGATRON.plan(lengths, large_chunk_cost, config)
    assert many.report.predicted_step_ms > megatron.report.predicted_step_ms * 1.2  # the pin's premise: many chunks cost
    assert step.report.chosen == MEGATRON.plan_name and step.plan.builder == ELASTIC.plan_name
    assert step.report.predicted_step_ms <= megatron.report.predicted_step_ms * (1 + 1e-9)
    assert sum(len(p.chunks) for p in step.plan.pipelines) == sum(len(p.chunks) for p in megatron.plan.pipelines)
    assert MEGATRON.plan_name in step.plan.summary(step.report.chosen)
