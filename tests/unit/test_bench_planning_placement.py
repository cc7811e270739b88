"""benchmarks/bench_planning_placement.py's own logic, without torchrun: the figures on synthetic step records (the ratio's
direction, noise floors, planning times), the report line, the runs' command lines (parsed by pretrain_gpt.py's
parser, the placement the only difference), and bad input in one line."""

from __future__ import annotations

import json

import pytest

from megatron_epp.training.metrics import ElasticMetrics, StepMetrics
from benchmarks import bench_planning_placement
from tests.unit.test_benchmark_cli import one_line_error


@pytest.fixture(scope="module")
def bench():
    return bench_planning_placement


def record(iteration: int, iter_ms: float, step_ms: float, planning_ms: float, exposed_ms: float) -> StepMetrics:
    return StepMetrics(iteration=iteration, loss=5.0, iter_ms=iter_ms, tokens=2048,
                       elastic=ElasticMetrics("plan[epp]", {"batched": 1, "split": 0, "hybrid": 0}, 1, 0, planning_ms,
                                              exposed_ms, 100.0, step_ms, None, None))


def test_figures_and_report(bench, capsys):
    """Between steps 10 % faster per iteration (the warm-up step left out, whatever it took), the timed step 20 %
    faster, its planning exposed; the repeats 1.0, 1.1 and 0.9 of each other."""
    base = [400.0, 300.0, 200.0, 250.0]

    def runs(iter_f: float, step_f: float, planning: float, exposed: float) -> list[list[StepMetrics]]:
        return [[record(i + 1, (9999.0 if i == 0 else ms) * iter_f * f, ms * step_f * f, planning, exposed)
                 for i, ms in enumerate(base)] for f in (1.0, 1.1, 0.9)]

    figures = bench.summarize({"background": runs(1.0, 1.0, 90.0, 0.2), "between": runs(0.9, 0.8, 60.0, 61.0)})
    assert figures["iter_ratio"] == pytest.approx(0.9) and figures["step_ratio"] == pytest.approx(0.8)
    assert figures["noise"] == {"background": pytest.approx(1 / 9), "between": pytest.approx(1 / 9)}
    assert figures["iter_ms"]["background"] == pytest.approx(250.0) and figures["step_ms"]["between"] == pytest.approx(200.0)
    assert figures["planning_ms"] == {"background": 90.0, "between": 60.0}
    assert figures["exposed_ms"] == {"background": 0.2, "between": 61.0}
    print(bench.report("cp2", figures))
    line = capsys.readouterr().out
    assert "cp2: between / background: iteration 0.900, timed step 0.800" in line and "between 11.1%" in line
    json.loads(json.dumps(figures))


def test_command_lines_differ_only_by_the_placement(bench, monkeypatch, tmp_path):
    from megatron_epp.training.replay import parsed_config

    for name in ("data", "stdlib"):  # the flags are checked, not read
        for ext in (".bin", ".idx"):
            (tmp_path / f"{name}{ext}").touch()
    monkeypatch.setattr("benchmarks.common.wiki_dataset", lambda *_: str(tmp_path / "data"))
    monkeypatch.setattr("megatron_epp.data.stdlib_corpus.ensure_stdlib_corpus", lambda: tmp_path / "stdlib")
    for name, layout in (("main-job", (2, 1)), ("cp2", (1, 2))):
        argv = bench.config_argv(name, 12, 0.0264)
        configs = {p: parsed_config([*argv, *bench.placement_flags(p)], 2) for p in bench.PLACEMENTS}
        assert {p: c.epp.plan_between_steps for p, c in configs.items()} == {"background": False, "between": True}
        cfg = configs["background"]
        assert (cfg.parallel.pipeline_model_parallel_size, cfg.parallel.context_parallel_size) == layout
        assert cfg.training.train_iters == 12
    assert "0.0264" in bench.config_argv("cp2", 12, 0.0264)


def test_bad_input_is_one_line(bench, capsys):
    for argv, said in ((["--configs", "main-job,nope"], "--configs: unknown nope"),
                       (["--iters", "2"], "--iters 2: needs at least 3"),
                       (["--repeats", "0"], "--repeats must be >= 1"),
                       (["--cp2-budget", "0"], "--cp2-budget must be positive")):
        assert said in one_line_error(capsys, lambda: bench.parse(argv))
