"""pretrain_gpt.py end to end on CPU: loss goes down, and resume from a checkpoint is exact."""

from __future__ import annotations

from tests.launch import logged_losses, torchrun

RUN = ["pretrain_gpt.py", "--mock-data", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
       "--seq-length", "64", "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "5e-3",
       "--lr-warmup-iters", "2", "--lr-decay-iters", "20", "--log-interval", "1"]


def test_twenty_steps_reduce_the_loss():
    losses = logged_losses(torchrun(2, *RUN, "--train-iters", "20").stdout)
    assert sorted(losses) == list(range(1, 21))
    first, last = float(losses[1]), sum(float(losses[i]) for i in range(16, 21)) / 5
    assert last < 0.8 * first, f"loss {first} -> {last}"


def test_resume_from_step_10_repeats_steps_11_to_20(tmp_path):
    straight = logged_losses(torchrun(2, *RUN, "--train-iters", "20").stdout)
    ckpt = str(tmp_path / "ckpt")
    first = torchrun(2, *RUN, "--train-iters", "10", "--save", ckpt, "--save-interval", "5")
    assert "saved checkpoint at iteration 10" in first.stdout
    assert all(logged_losses(first.stdout)[i] == straight[i] for i in range(1, 11))
    resumed = logged_losses(torchrun(2, *RUN, "--train-iters", "20", "--load", ckpt).stdout)
    assert sorted(resumed) == list(range(11, 21))
    assert all(resumed[i] == straight[i] for i in range(11, 21)), (resumed, straight)
