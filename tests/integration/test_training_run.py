"""pretrain_gpt.py end to end on CPU: loss goes down, resume from a checkpoint is exact, and every
logged step writes its metrics record."""

from __future__ import annotations

import re

from megatron_epp.training.metrics import read_metrics
from tests.launch import torchrun

RUN = ["pretrain_gpt.py", "--mock-data", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
       "--seq-length", "64", "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "5e-3",
       "--lr-warmup-iters", "2", "--lr-decay-iters", "20", "--log-interval", "1"]


def losses(path) -> dict[int, float]:
    return {m.iteration: m.loss for m in read_metrics(path) if m.kind == "train"}


def test_twenty_steps_reduce_the_loss(tmp_path):
    torchrun(2, *RUN, "--train-iters", "20", "--epp-metrics", str(tmp_path / "m.jsonl"))
    loss = losses(tmp_path / "m.jsonl")
    assert sorted(loss) == list(range(1, 21))
    first, last = loss[1], sum(loss[i] for i in range(16, 21)) / 5
    assert last < 0.8 * first, f"loss {first} -> {last}"


def test_resume_from_step_10_repeats_steps_11_to_20(tmp_path):
    """Data parallel 2 with --use-distributed-optimizer (each rank saves its shard of the Adam states): the
    run saves at 10 and 20; resumed from 10 (the tracker set back to it, as after a job that stopped there)
    it repeats steps 11..20 bit for bit. The plain optimizer's resume is checked at pp 2 by the elastic runs
    (tests/integration/test_faults.py, tests/integration/test_elastic_training.py)."""
    flags = [*RUN, "--pipeline-model-parallel-size", "1", "--use-distributed-optimizer", "--train-iters", "20"]
    ckpt = tmp_path / "ckpt"
    first = torchrun(2, *flags, "--save", str(ckpt), "--save-interval", "10").stdout
    assert "dp=2" in first and "saved checkpoint at iteration 10" in first, first[-3000:]
    straight = losses(ckpt / "metrics.jsonl")
    assert sorted(straight) == list(range(1, 21))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    torchrun(2, *flags, "--load", str(ckpt), "--epp-metrics", str(tmp_path / "resumed.jsonl"))
    resumed = losses(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == list(range(11, 21))
    assert all(resumed[i] == straight[i] for i in range(11, 21)), (resumed, straight)


def test_one_record_per_logged_step_as_printed(tmp_path):
    """--log-interval 2 and --eval-interval 2 over 4 steps: two training and two validation records in
    metrics.jsonl beside the checkpoint, each printing the line that the log shows (but for its interval averages)."""
    out = torchrun(2, *RUN, "--train-iters", "4", "--log-interval", "2", "--eval-interval", "2", "--eval-iters", "1",
                   "--save", str(tmp_path / "ckpt")).stdout
    records = read_metrics(tmp_path / "ckpt" / "metrics.jsonl")
    assert [(m.iteration, m.kind) for m in records] == [(2, "train"), (2, "valid"), (4, "train"), (4, "valid")]
    printed = [line for line in out.splitlines() if line.startswith((" iteration", " validation"))]
    # the line averages ms/iter, tokens/s and lm loss over the --log-interval iterations (Megatron-LM's), the record is
    # the logged iteration's own: the rest agrees
    mask = lambda line: re.sub(r"(elapsed time per iteration \(ms\)|tokens/s|lm loss): [^|]+", r"\1: ~", line)  # noqa: E731
    assert [mask(line) for line in printed] == [mask(m.line()) for m in records]
    train = [m for m in records if m.kind == "train"]
    assert [m.consumed_samples for m in train] == [16, 32] and all(m.tokens == 8 * 64 for m in train)
    assert all(m.train_iters == 4 and m.iter_ms > 0 and m.lr > 0 and m.grad_norm > 0 and m.elastic is None for m in train)
