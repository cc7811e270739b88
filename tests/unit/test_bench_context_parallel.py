"""benchmarks/bench_context_parallel.py's own logic, without torchrun: the budget choice on the cp 1 and cp 2 planners,
the figures and verdicts on synthetic step records, today's accuracy read from the committed log, the JSON line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_epp.training.metrics import ElasticMetrics, StepMetrics
from tests.paths import REPO
from benchmarks import bench_context_parallel
from benchmarks.common import GRID_GB
from benchmarks.paired_runs import ACCURACY_LOG
from tests.unit.test_benchmark_cli import one_line_error

CAP = 1024
BATCHES = [[1024, 300, 40], [1024, 1024, 9], [700, 120, 30]]


@pytest.fixture(scope="module")
def bench():
    return bench_context_parallel


@pytest.fixture(scope="module")
def builds():
    """The runs' planners at cp 1 (one rank) and cp 2 (two ranks, one stage): 2 layers, hidden 64, 4 heads."""
    from megatron_epp.training.planning import online_planner
    from megatron_epp.training.replay import parsed_config

    argv = ["--elastic-pp", "--mock-data", "--pipeline-model-parallel-size", "1", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", str(CAP), "--global-batch-size", "3", "--lr", "3e-3",
            "--train-iters", "3", "--epp-memory-budget", "1"]
    cp2 = ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]
    return {1: online_planner(parsed_config(argv, 1)), 2: online_planner(parsed_config([*argv, *cp2], 2))}


def test_budget_binds_for_cp1_and_not_for_cp2(bench, builds):
    budget = bench.choose_budget(BATCHES, builds)
    plans = bench.plan_facts(BATCHES, builds, budget)
    cp1, cp2 = (bench.recomputed(plans[cp]) for cp in (1, 2))
    assert cp2 == [0, 0, 0] and cp1 is not None and sum(cp1) > 0  # cp 1 must recompute where cp 2 need not
    below = bench.plan_facts(BATCHES, builds, budget - GRID_GB)  # the smallest such budget on the grid
    assert below[1] is None or below[2] is None or sum(bench.recomputed(below[2])) > 0
    # the same model states per rank (weights replicated over CP): the budget binds through the activations alone
    assert builds[2].cost_model.model_state_bytes()[0] == builds[1].cost_model.model_state_bytes()[0]


def record(iteration: int, predicted: float, measured: float, recomputed: int, act: float, plan: str = "plan[x]") -> StepMetrics:
    return StepMetrics(iteration=iteration, loss=5.0, train_iters=8, iter_ms=measured + 5, tokens=2048, lr=1e-3, grad_norm=1.0,
                       elastic=ElasticMetrics(plan, {"batched": 1, "split": 2, "hybrid": 0}, 1, recomputed, 3.0, 0.0, predicted,
                                              measured, [act], [int(act)], model_state_bytes=[1e6]))


def run(measured: list[float], predicted: list[float], recomputed: list[int], act: float) -> list[StepMetrics]:
    return [record(i + 1, p, m, r, act) for i, (m, p, r) in enumerate(zip(measured, predicted, recomputed))]


def test_figures_verdicts_and_json_line(bench, capsys):
    # 8 steps; after step 5 (steps 6-8) cp 2 is predicted 5 % short on every step, cp 1 exactly
    ms1, ms2 = [400, 300, 300, 300, 300, 300, 300, 300], [300, 200, 200, 200, 200, 200, 200, 200]
    pred1, pred2 = ms1, [m * 0.95 for m in ms2]
    runs = {1: [run([m * f for m in ms1], [p * f for p in pred1], [4, 8, 3, 8, 4, 4, 4, 4], 8e6) for f in (1.0, 1.1, 0.9)],
            2: [run([m * f for m in ms2], [p * f for p in pred2], [0, 2, 0, 0, 0, 0, 0, 0], 4e6) for f in (1.0, 1.1, 0.9)]}
    for r in runs[2]:
        for s in r:
            s.elastic.measured_cp_activation_bytes = [[4e6, 3.9e6]]  # the larger is the rank's measured peak
    budget = 0.01
    entries = {f"cp{cp}": bench.summarize(r, budget) for cp, r in runs.items()}
    one, two = entries["cp1"], entries["cp2"]
    assert one["recomputed_totals"] == [39] * 3 and two["recomputed"] == [[0, 2, 0, 0, 0, 0, 0, 0]] * 3
    assert two["pred_err_median"] == pytest.approx(0.05) and two["pred_err_max"] == pytest.approx(0.05) and two["pred_err_steps"] == 9
    assert two["hindsight_max"] == pytest.approx(0.0, abs=1e-12)  # a scale error only: one factor removes it
    assert one["pred_err_median"] == pytest.approx(0.0) and one["act_worst_err"] == 0.0 and one["fits"]
    assert one["act_meas_mb"] == [pytest.approx(8e6 / 2**20)] and two["measured_ms"] == pytest.approx(200)
    assert one["states_mb"] == [pytest.approx(1e6 / 2**20)] and one["act_meas_cp_mb"] is None
    assert two["act_meas_cp_mb"] == [[pytest.approx(4e6 / 2**20), pytest.approx(3.9e6 / 2**20)]]
    assert two["noise"] == pytest.approx(1 / 9)  # |1.1 / 0.9 - 1|, |1 / 1.1 - 1|, |1 / 0.9 - 1|: median 1/9
    assert len(two["per_step"]) == 9 and two["per_step"][0][:2] == [0, 6] and two["plans_differ"] == 0
    assert two["speed_factor"] == [None] * 3  # the synthetic records carry no calibration
    assert not bench.summarize(runs[1], 1e6 / 2**30)["fits"]  # model states + peak over the budget
    today = bench.today_accuracy(ACCURACY_LOG)
    assert today["log"] == "docs/measurements/2026-11-24-cpu/time_model_accuracy_fc6a2b3.log"
    assert today["median_max"] == pytest.approx(0.0865, abs=5e-4) and today["worst_step"] == pytest.approx(0.194, abs=5e-4)
    assert bench.verdicts(entries, today) == {"less_recompute": True, "within_today": True}
    assert bench.verdicts(entries, {**today, "median_max": 0.04})["within_today"] is False
    worse = {**entries, "cp2": {**two, "recomputed": [*two["recomputed"][:2], [5, 0, 0, 0, 0, 0, 0, 0]]}}
    assert bench.verdicts(worse, today)["less_recompute"] is False  # more than cp 1 on a step in one repeat: not less
    verdict = bench.report(entries, 0.66, 0.6, today, budget, {})
    out = capsys.readouterr().out
    assert verdict["within_today"] and "cp 2 recomputes less than cp 1: yes" in out and "step time measured 0.66" in out
    json.loads(json.dumps({**entries, "verdict": verdict}))  # the JSON line's entries serialize


def test_bad_input_is_one_line(bench, capsys):
    for argv, said in ((["--iters", "5"], "--iters 5: needs steps after the first calibration"),
                       (["--num-attention-heads", "3"], "cp 2 must divide it"),
                       (["--epp-memory-budget", "0"], "--epp-memory-budget must be positive")):
        assert said in one_line_error(capsys, lambda: bench.parse(argv))
    assert "not a time_model_accuracy.py log" in one_line_error(capsys, lambda: bench.today_accuracy(REPO / "README.md"))
    assert np.isfinite(bench.parse([]).iters)


def test_both_configurations_plan_between_steps_unless_told_not_to(bench, monkeypatch, tmp_path):
    """The runs' command lines parse with pretrain_gpt.py's parser; by default both configurations plan between steps
    (cp 2's two ranks take both cores: the planner's thread would share one inside the timed steps), with
    ``--no-epp-plan-between-steps`` in the background as training does by default."""
    from megatron_epp.training.replay import parsed_config

    for ext in (".bin", ".idx"):  # the flags are checked, not read
        (tmp_path / f"data{ext}").touch()
    monkeypatch.setattr("benchmarks.common.wiki_dataset", lambda *_: str(tmp_path / "data"))
    for argv, between in (([], True), (["--no-epp-plan-between-steps"], False)):
        args = bench.parse(argv)
        assert "between steps" in bench.header(args) if between else "in the background" in bench.header(args)
        for cp in (1, 2):
            cfg = parsed_config([*bench.cp_run_argv(args, cp), "--epp-memory-budget", "1"], cp)
            assert cfg.epp.plan_between_steps is between and cfg.parallel.context_parallel_size == cp
