"""--train-samples (Megatron-LM: total samples instead of --train-iters) and the LR schedule in samples."""

from __future__ import annotations

import pytest

from megatron_epp.config.parser import parse_config
from megatron_epp.config.errors import ArgumentError

BASE = ["--mock-data", "--global-batch-size", "8"]


def test_iterations_and_schedule_from_samples():
    cfg = parse_config([*BASE, "--train-samples", "36", "--lr-warmup-samples", "8", "--lr-decay-samples", "64"], world_size=1)
    assert cfg.training.train_iters == 4  # floor(36 / 8), as Megatron-LM; the start-up line names the 4 samples left over
    assert (cfg.optim.lr_warmup_samples, cfg.optim.lr_decay_samples) == (8, 64)
    cfg = parse_config([*BASE, "--train-samples", "40"], world_size=1)
    assert (cfg.training.train_iters, cfg.optim.lr_warmup_samples, cfg.optim.lr_decay_samples) == (5, 0, 40)  # decay over all samples
    cfg = parse_config([*BASE, "--train-iters", "5", "--lr-warmup-iters", "1"], world_size=1)
    assert (cfg.training.train_samples, cfg.optim.lr_warmup_samples, cfg.optim.lr_decay_samples) == (None, 8, 40)  # iterations x batch
    assert parse_config(BASE, world_size=1).training.train_iters == 20  # the default without either


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--train-samples", "40", "--train-iters", "5"], "--train-iters and --train-samples are mutually exclusive"),
        (["--train-samples", "40", "--lr-decay-iters", "5"], "--lr-decay-iters counts iterations; with --train-samples give the schedule in samples (--lr-decay-samples)"),
        (["--train-samples", "40", "--lr-warmup-iters", "1"], "--lr-warmup-iters counts iterations"),
        (["--train-iters", "5", "--lr-decay-samples", "40"], "--lr-decay-samples applies with --train-samples; with --train-iters give --lr-decay-iters"),
        (["--train-samples", "40", "--lr-wsd-decay-iters", "3"], "--lr-wsd-decay-iters counts iterations; with --train-samples give --lr-wsd-decay-samples"),
        (["--train-iters", "5", "--lr-wsd-decay-samples", "8"], "--lr-wsd-decay-samples applies with --train-samples; with --train-iters give --lr-wsd-decay-iters"),
        (["--train-samples", "7"], "--train-samples 7 is less than one --global-batch-size 8"),
        (["--train-samples", "40", "--lr-warmup-samples", "40"], "--lr-warmup-samples 40 must be smaller than --lr-decay-samples 40"),
    ],
)
def test_bad_combinations(flags, message):
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config([*BASE, *flags], world_size=1)
