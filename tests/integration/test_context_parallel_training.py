"""pretrain_gpt.py --elastic-pp --context-parallel-size 2 end to end on CPU: killed and resumed, it repeats the
uninterrupted run's steps bit for bit; each CP rank's measured activation peak is the planner's prediction for a CP rank (to
the byte), printed per stage and CP rank. (That cp 2 gives the loss and gradients of the non-parallel reference:
tests/integration/test_elastic_equivalence.py's test_context_parallel_*.)"""

from __future__ import annotations

from megatron_epp.training.metrics import read_metrics
from tests.launch import torchrun, torchrun_killed_after

RUN = ["pretrain_gpt.py", "--elastic-pp", "--context-parallel-size", "2", "--mock-data", "--num-layers", "2",
       "--hidden-size", "32", "--seq-length", "256", "--global-batch-size", "8", "--lr", "5e-3", "--lr-warmup-iters", "2",
       "--train-iters", "8", "--log-interval", "1", "--epp-memory-budget", "0.006", "--epp-calibrate-interval", "0",
       "--use-distributed-optimizer"]


def test_killed_context_parallel_run_resumes_with_the_uninterrupted_losses(tmp_path):
    """cp 2 (2 ranks, one stage) with --use-distributed-optimizer (its states sharded over DP x CP: each CP rank holds
    half): SIGKILL after iteration 6, last checkpoint at 4 (each CP rank's RNG and planner state saved as its own
    object, the layout record saying cp 2); --load repeats 5 and 6 with the same plans and
    losses bit for bit, and trains to 8. Every step's log line has the measured peak of each CP rank, equal to the byte
    to the planner's prediction for a CP rank (the memory model's cp share, calibration off; as at cp 1:
    tests/integration/test_elastic_training.py; each rank's token ids, loss mask and positions in storages of their
    own, not views of the whole chunk's, which the embedding and the loss would save: 12 B a local token more).
    Without the cp share the prediction is twice the measured peak."""
    ckpt = tmp_path / "ckpt"
    killed = torchrun_killed_after("iteration        6/", 2, *RUN, "--save", str(ckpt), "--save-interval", "4",
                                   "--epp-metrics", str(tmp_path / "killed.jsonl"))
    assert "cp=2" in killed and "saved checkpoint at iteration 4" in killed and "saved checkpoint at iteration 8" not in killed
    assert '"context_parallel_size": 2' in (ckpt / "iter_0000004" / "epp_metadata.json").read_text()
    resumed = torchrun(2, *RUN, "--load", str(ckpt), "--epp-metrics", str(tmp_path / "resumed.jsonl")).stdout
    assert "resumed at iteration 4" in resumed
    before = {m.iteration: m for m in read_metrics(tmp_path / "killed.jsonl")}
    after = {m.iteration: m for m in read_metrics(tmp_path / "resumed.jsonl")}
    assert sorted(after) == list(range(5, 9)) and {5, 6} <= set(before)
    for i in (5, 6):
        assert (after[i].loss, after[i].elastic.plan) == (before[i].loss, before[i].elastic.plan), i
    printed = [line for line in killed.splitlines() if line.startswith(" iteration")]
    for m in (before[i] for i in range(1, 7)):  # the lines read before the kill (later records may have been written)
        e = m.elastic
        assert e.memory_factor == 1.0 and len(e.measured_cp_activation_bytes) == 1 and len(e.measured_cp_activation_bytes[0]) == 2
        assert all(measured == e.predicted_activation_bytes[0] for measured in e.measured_cp_activation_bytes[0]), e
        assert e.measured_activation_bytes == [max(e.measured_cp_activation_bytes[0])]
        assert m.line() in printed and "act MB meas per stage and CP rank: " in m.line()
