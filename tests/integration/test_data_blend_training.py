"""Training on a blended --data-path (Megatron's 0.3 A 0.7 B) end to end; the blend itself: tests/unit/test_data_blend.py."""

from __future__ import annotations

import pytest

from megatron_epp.training.metrics import read_metrics
from tests.corpus import write_corpus
from tests.launch import torchrun


def test_training_on_a_blend_end_to_end(tmp_path):
    """pretrain_gpt.py on a blend, both paths: --elastic-pp with --train-samples, --log-throughput and
    --tensorboard-dir; the stock path with --lr-decay-samples (the LR follows the schedule in samples)."""
    a = write_corpus(tmp_path / "a", [f"alpha {i} " * (3 + i % 7) for i in range(60)])
    b = write_corpus(tmp_path / "b", [f"beta {i} " * (2 + i % 5) for i in range(60)])
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "128",
             "--split", "1,0,0", "--data-path", "0.25", a, "0.75", b, "--global-batch-size", "4", "--lr", "1e-3"]
    out = torchrun(1, "pretrain_gpt.py", *model, "--elastic-pp", "--train-samples", "14", "--log-throughput",
                   "--tensorboard-dir", str(tmp_path / "tb"), "--epp-calibrate-interval", "0").stdout
    assert f"> data: blend of 0.25 {a}, 0.75 {b}; train split: 120 docs" in out
    assert "--train-samples 14: 3 iterations (2 samples short of a global batch not trained)" in out
    records = read_metrics(tmp_path / "tb" / "metrics.jsonl")
    assert [r.iteration for r in records] == [1, 2, 3] and all(r.tflops_per_gpu > 0 for r in records)
    assert "throughput per GPU (TFLOP/s/GPU): " in out
    assert any((tmp_path / "tb").glob("events.out.tfevents.*"))

    out = torchrun(1, "pretrain_gpt.py", *model, "--train-samples", "16", "--lr-decay-samples", "64", "--lr-decay-style",
                   "linear", "--epp-metrics", str(tmp_path / "stock.jsonl")).stdout
    lrs = [r.lr for r in read_metrics(tmp_path / "stock.jsonl")]
    # linear decay over 64 samples, 4 per iteration: 1 - 4k/64 after iteration k (over --train-samples it would be 1 - 4k/16)
    assert lrs == pytest.approx([1e-3 * (1 - 4 * k / 64) for k in range(1, 5)])
