"""pretrain_gpt.py --elastic-pp: 30 steps of real training at pp=2; same loss curve as Megatron packing."""

from __future__ import annotations

import pytest

from megatron_epp.training.metrics import read_metrics
from tests.launch import torchrun, torchrun_killed_after

RUN = ["pretrain_gpt.py", "--elastic-pp", "--mock-data", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
       "--hidden-size", "32", "--seq-length", "512", "--global-batch-size", "8", "--lr", "5e-3",
       "--lr-warmup-iters", "3", "--train-iters", "30", "--log-interval", "1", "--epp-memory-budget", "0.006"]


def run_records(tmp_path, *flags: str) -> tuple[str, list]:
    """``torchrun`` the elastic run with ``flags``: its log and its training-step metrics records."""
    path = tmp_path / f"metrics-{len(list(tmp_path.glob('metrics-*')))}.jsonl"
    out = torchrun(2, *RUN, *flags, "--epp-metrics", str(path)).stdout
    return out, [m for m in read_metrics(path) if m.kind == "train"]


def test_elastic_trains_and_matches_megatron_packing(tmp_path):
    """The elastic builder's plans and Seq1F1B's (split and hybrid chunks: prefix K/V on every step; at this tiny
    shape and budget the elastic builder packs whole sequences, as slicing's per-chunk constants cost more than
    it saves) train the loss curve of Megatron packing (planned between steps: --epp-plan-between-steps)."""
    elastic_out, elastic = run_records(tmp_path, "--epp-calibrate-interval", "10")
    megatron_out, megatron = run_records(tmp_path, "--epp-plan", "megatron", "--epp-plan-between-steps")
    _, sliced = run_records(tmp_path, "--epp-plan", "seq1f1b", "--epp-max-slices", "4", "--epp-calibrate-interval", "0")
    assert [m.iteration for m in elastic] == list(range(1, 31)) == [m.iteration for m in megatron] == [m.iteration for m in sliced]
    for ours, split, theirs in zip(elastic, sliced, megatron):
        assert ours.loss == pytest.approx(theirs.loss, rel=1e-5), ours.iteration
        assert split.loss == pytest.approx(theirs.loss, rel=1e-5), split.iteration
    first, last = elastic[0].loss, sum(m.loss for m in elastic[20:]) / 10
    assert last < 0.8 * first
    assert any(m.elastic.num_chunks["split"] for m in sliced) and any(m.elastic.num_chunks["hybrid"] for m in sliced), \
        "Seq1F1B's plans never split"
    assert all(m.elastic.plan.startswith("plan[megatron]") for m in megatron)
    assert all(m.elastic.num_chunks["split"] == m.elastic.num_chunks["hybrid"] == 0 for m in megatron)
    # the records hold what the log lines print, with the plan's numbers and the measured memory of both stages
    printed = [line for line in elastic_out.splitlines() if line.startswith(" iteration")]
    assert printed == [m.line() for m in elastic]
    for m in elastic:
        e = m.elastic
        assert sum(e.num_chunks.values()) == int(e.plan.split(" chunks=")[1].split()[0]) and e.num_pipelines >= 1
        assert e.predicted_step_ms > 0 and e.measured_ms > 0 and e.planning_ms > 0 and e.planning_wait_ms >= 0
        assert len(e.predicted_activation_bytes) == len(e.measured_activation_bytes) == 2
    # the planner's time inside each step's span: a part of the next step's plan's (made while the step ran)
    for m, after in zip(elastic, elastic[1:]):
        assert 0 <= m.elastic.planning_overlap_ms <= after.elastic.planning_ms, m.iteration
    assert any(m.elastic.planning_overlap_ms > 0 for m in elastic)
    assert "> planning: each global batch in a background thread of the first rank" in elastic_out
    # --epp-plan-between-steps (the Megatron-packing run): no planner time inside any step, all of it exposed
    assert all(m.elastic.planning_overlap_ms == 0 and m.elastic.planning_wait_ms >= m.elastic.planning_ms > 0 for m in megatron)
    assert "> planning: each global batch between steps (--epp-plan-between-steps)" in megatron_out
    # the driver calibrated its cost model on the measured steps (--epp-calibrate-interval 10): after steps 5,
    # 15 and 25, each change announced by one line, the steps after it predicted on the new fit
    calibrations = [(m.elastic.speed_factor, m.elastic.stage_overhead_ms) for m in elastic]
    assert len(set(calibrations[:5])) == 1 and calibrations[0][0] == 1.0
    changed = [m.iteration for m, before in zip(elastic[1:], calibrations) if (m.elastic.speed_factor, m.elastic.stage_overhead_ms) != before]
    assert changed == [6, 16, 26], changed
    assert elastic_out.count(" cost model calibrated on this machine's steps: speed factor s") == 3


def test_planning_overlaps_training_and_timelines_are_drawn(tmp_path):
    run = [a for a in RUN]
    run[run.index("--train-iters") + 1] = "6"
    out = torchrun(2, "tests/workers/count_plans.py", *run[1:], "--log-interval", "2", "--epp-timeline", str(tmp_path / "timeline"),
                   "--tensorboard-dir", str(tmp_path / "tb")).stdout
    waits = [m.elastic.planning_wait_ms for m in read_metrics(tmp_path / "tb" / "metrics.jsonl")]
    assert len(waits) == 3 and min(waits) < 1.0, waits  # the next step's plan is made during this one
    # one plan per step on the planning rank (the first of the replica), none past the last step: the run's
    # end waits for no plan of a step that never comes (every rank also plans the start-up memory check's batch)
    assert "rank 0: plans made: 7" in out and "rank 1: plans made: 1" in out, out[-2000:]
    pictures = sorted(p.name for p in (tmp_path / "timeline").iterdir())
    assert pictures == ["plan_iter_0000002.png", "plan_iter_0000004.png", "plan_iter_0000006.png"]
    assert all((tmp_path / "timeline" / p).stat().st_size > 10_000 for p in pictures)


@pytest.mark.parametrize("placement", [[], ["--epp-plan-between-steps"]], ids=["background", "between-steps"])
def test_killed_elastic_run_resumes_with_the_uninterrupted_losses(tmp_path, placement):
    """SIGKILL every rank mid-run (after iteration 9, last checkpoint at 5, the planner's first calibration);
    --load repeats 6..8 of the killed run exactly: the same plans, predicted on the same calibration (restored
    from the checkpoint, not refitted on the resumed run's own times), the same losses bit for bit. With the planner
    in the background step 6 was planned before the fit after step 5, between steps after it: either way as the
    resumed run plans it."""
    run = [*RUN, *placement]
    run[run.index("--train-iters") + 1] = "12"
    killed = torchrun_killed_after("iteration        9/", 2, *run, "--save", str(tmp_path / "ckpt"), "--save-interval", "5",
                                   "--epp-metrics", str(tmp_path / "killed.jsonl"))
    assert "saved checkpoint at iteration 5" in killed and "saved checkpoint at iteration 10" not in killed
    resumed = torchrun(2, *run, "--load", str(tmp_path / "ckpt"), "--epp-metrics", str(tmp_path / "resumed.jsonl")).stdout
    assert "resumed at iteration 5" in resumed
    before = {m.iteration: m for m in read_metrics(tmp_path / "killed.jsonl")}
    after = {m.iteration: m for m in read_metrics(tmp_path / "resumed.jsonl")}
    assert sorted(after) == list(range(6, 13)) and {6, 7, 8} <= set(before)
    assert before[6].elastic.speed_factor != before[5].elastic.speed_factor  # calibrated after step 5
    for i in (6, 7, 8):
        b, a = before[i], after[i]
        assert (a.loss, a.elastic.plan, a.elastic.speed_factor, a.elastic.stage_overhead_ms, a.elastic.predicted_step_ms) == \
            (b.loss, b.elastic.plan, b.elastic.speed_factor, b.elastic.stage_overhead_ms, b.elastic.predicted_step_ms), i


def test_measured_activation_memory_follows_the_prediction_and_recompute(tmp_path):
    """Per stage: measured peaks equal to the byte the planner's prediction (shipped profile's shape, hidden 64; the
    CPU tracker's count is exact, as tests/integration/test_planner_memory.py and tests/integration/test_llama_style.py hold it: a K/V buffer
    counted at half its size is 1-3 % off here), with no and with full recompute, and full recompute measurably below
    no recompute."""
    run = [a for a in RUN]
    for flag, value in (("--train-iters", "4"), ("--hidden-size", "64"), ("--seq-length", "1024"), ("--global-batch-size", "16")):
        run[run.index(flag) + 1] = value

    def peaks(mode: str) -> list[list[tuple[float, float]]]:
        torchrun(2, *run, "--epp-recompute", mode, "--epp-memory-budget", "0.05", "--epp-metrics", str(tmp_path / f"{mode}.jsonl"))
        records = read_metrics(tmp_path / f"{mode}.jsonl")
        assert len(records) == 4
        return [list(zip(m.elastic.predicted_activation_bytes, m.elastic.measured_activation_bytes)) for m in records]

    none, full = peaks("none"), peaks("full")
    for step in none + full:
        assert all(predicted == measured for predicted, measured in step), step
    for step_none, step_full in zip(none, full):
        assert all(f[1] < 0.5 * n[1] for n, f in zip(step_none, step_full)), (step_none, step_full)
