"""benchmarks/bench_offload.py's own logic, without torchrun: the budget choice on the two configurations' planners,
the figures and verdicts on synthetic step records (the host figures of benchmarks/paired_runs.py), the runs' flags, bad
input in one line."""

from __future__ import annotations

import json

import pytest

from megatron_epp.training.metrics import ElasticMetrics, StepMetrics
from benchmarks import bench_offload
from benchmarks.common import GRID_GB
from benchmarks.paired_runs import ACCURACY_LOG, summarize, today_accuracy
from tests.unit.test_benchmark_cli import one_line_error

CAP = 1024
BATCHES = [[1024, 300, 40], [1024, 1024, 9], [700, 120, 30]]


@pytest.fixture(scope="module")
def builds():
    """The runs' planners at pp 2 (two ranks): 4 layers, hidden 64, 4 heads, offload none and checkpoints."""
    from megatron_epp.training.planning import online_planner
    from megatron_epp.training.replay import parsed_config

    argv = ["--elastic-pp", "--mock-data", "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", str(CAP), "--global-batch-size", "3", "--lr", "3e-3",
            "--train-iters", "3", "--epp-memory-budget", "1"]
    return {mode: online_planner(parsed_config([*argv, "--epp-offload", mode], 2)) for mode in bench_offload.MODES}


def test_budget_is_the_smallest_both_run_at_and_binds(builds):
    """Both plan at the chosen budget, one grid step below one cannot; memory binds there (none recomputes), and with the
    host for checkpoints the plans recompute fewer layers in total."""
    budget = bench_offload.choose_budget(BATCHES, builds)
    plans = bench_offload.plan_facts(BATCHES, builds, budget)
    none, ckpt = (bench_offload.recomputed(plans[m]) for m in bench_offload.MODES)
    assert none is not None and ckpt is not None and sum(none) > 0
    assert sum(ckpt) < sum(none) and any(p.plan.offloaded_layers() for p in plans["checkpoints"])
    below = bench_offload.plan_facts(BATCHES, builds, budget - GRID_GB)
    assert below["none"] is None or below["checkpoints"] is None


def record(iteration: int, predicted: float, measured: float, recomputed: int, offloaded: int, host: tuple | None) -> StepMetrics:
    return StepMetrics(iteration=iteration, loss=5.0, train_iters=8, iter_ms=measured + 5, tokens=2048, lr=1e-3, grad_norm=1.0,
                       elastic=ElasticMetrics("plan[x]", {"batched": 1, "split": 2, "hybrid": 0}, 1, recomputed, 3.0, 0.0, predicted,
                                              measured, [8e6, 8e6], [8000000, 8000000], model_state_bytes=[1e6, 1e6],
                                              offloaded_layers=offloaded, predicted_host_bytes=None if host is None else list(host[0]),
                                              measured_host_bytes=None if host is None else list(host[1])))


def run(recomputed: list[int], offloaded: list[int], host: tuple | None, error: float = 0.0) -> list[StepMetrics]:
    return [record(i + 1, 300 * (1 + error), 300, r, o, host if o else None) for i, (r, o) in enumerate(zip(recomputed, offloaded))]


def test_figures_verdicts_and_json_line(capsys):
    none = [run([4, 8, 3, 8, 4, 4, 4, 4], [0] * 8, None) for _ in range(3)]
    ckpt = [run([2, 6, 3, 9, 2, 2, 2, 2], [2, 2, 0, 3, 2, 2, 2, 2], ((1e6, 2e6), (1000000, 2000000)), 0.05) for _ in range(3)]
    entries = {"none": summarize(none, 0.02), "checkpoints": summarize(ckpt, 0.02)}
    c = entries["checkpoints"]
    assert c["offloaded"][0] == [2, 2, 0, 3, 2, 2, 2, 2] and c["host_steps"] == 21 and c["host_exact"]
    assert c["host_pred_mb"] == [pytest.approx(1e6 / 2**20), pytest.approx(2e6 / 2**20)] and entries["none"]["host_pred_mb"] is None
    today = today_accuracy(ACCURACY_LOG)
    assert bench_offload.verdicts(entries, today) == {"less_recompute": True, "host_exact": True, "within_today": True}
    assert bench_offload.steps_more_recompute(entries) == 1  # step 4: 9 against 8
    off = [run([2] * 8, [2] * 8, ((1e6, 2e6), (1000000, 1999999))) for _ in range(3)]  # one stage's host peak 1 B short
    assert bench_offload.verdicts({**entries, "checkpoints": summarize(off, 0.02)}, today)["host_exact"] is False
    same = {**entries, "checkpoints": {**c, "recomputed_totals": [30, 29, 31]}}  # every repeat below none's 39
    assert bench_offload.verdicts(same, today)["less_recompute"] is True
    more = {**entries, "checkpoints": {**c, "recomputed_totals": [30, 39, 31]}}  # a repeat as many as none's least: not less
    assert bench_offload.verdicts(more, today)["less_recompute"] is False
    assert bench_offload.verdicts(entries, {**today, "median_max": 0.04})["within_today"] is False
    verdict = bench_offload.report(entries, 0.92, 0.9, today, 0.02, {})
    out = capsys.readouterr().out
    assert "checkpoints recomputes less than none: yes; its host prediction exact: yes" in out and "measured 0.92" in out
    json.loads(json.dumps({**entries, "verdict": verdict}))


def test_runs_differ_only_in_offload_and_bad_input_is_one_line(capsys, monkeypatch, tmp_path):
    from megatron_epp.training.replay import parsed_config

    for ext in (".bin", ".idx"):  # the flags are checked, not read
        (tmp_path / f"data{ext}").touch()
    monkeypatch.setattr("benchmarks.common.wiki_dataset", lambda *_: str(tmp_path / "data"))
    args = bench_offload.parse([])
    none, ckpt = (bench_offload.run_argv(args, m) for m in bench_offload.MODES)
    assert none[:-2] == ckpt[:-2] and none[-2:] == ["--epp-offload", "none"] and ckpt[-2:] == ["--epp-offload", "checkpoints"]
    cfg = parsed_config([*ckpt, "--epp-memory-budget", "1"], 2)
    assert cfg.epp.planner.offload == "checkpoints" and cfg.parallel.dims.pp == 2 and cfg.epp.plan_between_steps
    for argv, said in ((["--iters", "5"], "--iters 5: needs steps after the first calibration"),
                       (["--num-layers", "3"], "--num-layers 3: pp 2 must divide it"),
                       (["--epp-memory-budget", "0"], "--epp-memory-budget must be positive")):
        assert said in one_line_error(capsys, lambda: bench_offload.parse(argv))


def test_the_step_time_ratio_is_checkpoints_over_none():
    """``checkpoints / none``: a configuration twice as slow, measured and predicted, reads 2 (not 1/2)."""
    from benchmarks.paired_runs import paired_ratios

    none = [[record(i + 1, 300, 300, 0, 0, None) for i in range(8)] for _ in range(2)]
    slow = [[record(i + 1, 660, 600, 0, 2, ((1e6,), (1000000,))) for i in range(8)] for _ in range(2)]
    assert paired_ratios(none, slow) == (pytest.approx(2.0), pytest.approx(2.2))
