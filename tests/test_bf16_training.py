"""pretrain_gpt.py with --bf16 on CPU: the elastic path (pp=1, the one-GPU layout, and pp=2) and the
stock path train, with finite and falling losses. Every --bf16 run on the first GPU died in the first
LayerNorm because the model was never cast (Float16Module now does it; tests/test_gpu_readiness.py
checks the cast itself, which CPU's LayerNorm would not notice)."""

from __future__ import annotations

import math

from megatron_epp.training.metrics import read_metrics
from tests.launch import torchrun

ELASTIC = ["pretrain_gpt.py", "--elastic-pp", "--bf16", "--mock-data", "--num-layers", "2", "--hidden-size", "32",
           "--seq-length", "512", "--global-batch-size", "8", "--lr", "5e-3", "--lr-warmup-iters", "2", "--train-iters", "12",
           "--log-interval", "1",
           # the budgets below make split and hybrid chunks for the byte vocabulary unpadded (257 rows; padded
           # to 384 the logits of this 32-wide model take a third more of them)
           "--make-vocab-size-divisible-by", "1",
           # the recompute program of a degenerate finalist (every sequence in 1-token chunks) runs to its wall-clock
           # safety limit at these budgets: seconds a step, the same plans without it (the planner is tested elsewhere)
           "--epp-time-limit", "0.05"]
STOCK = ["pretrain_gpt.py", "--bf16", "--mock-data", "--pipeline-model-parallel-size", "2", "--num-layers", "2",
         "--hidden-size", "32", "--seq-length", "64", "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "5e-3",
         "--lr-warmup-iters", "2", "--train-iters", "12", "--log-interval", "1"]


def train_records(tmp_path, nproc: int, *argv: str):
    path = tmp_path / "metrics.jsonl"
    out = torchrun(nproc, *argv, "--epp-metrics", str(path)).stdout
    records = [m for m in read_metrics(path) if m.kind == "train"]
    losses = [m.loss for m in records]
    assert [m.iteration for m in records] == list(range(1, 13))
    assert all(math.isfinite(x) for x in losses) and all(m.grad_norm > 0 for m in records)
    assert sum(losses[-3:]) / 3 < 0.95 * losses[0], losses
    return out, records


# Budgets at which the planner (bf16 activations, the CPU profile) splits: checked in-process with
# megatron_epp.tools.calibration.reconstruct_plans (pp=1 at 1.5 MB: 6 of 12 steps split, 4 with a hybrid tail; pp=2 at 2 MB: 3 split).
def test_elastic_bf16_on_one_stage_splits_packs_and_learns(tmp_path):
    out, records = train_records(tmp_path, 1, *ELASTIC, "--pipeline-model-parallel-size", "1", "--epp-memory-budget", "0.0015")
    assert any(m.elastic.num_chunks["split"] for m in records) and any(m.elastic.num_chunks["hybrid"] for m in records)
    assert any(m.elastic.recomputed_layers for m in records)
    assert "on cpu bf16 |" in out
    assert "> layers: local spec + ElasticAttention" in out
    assert "> planner: --epp-profile cpu: measured on CPU" in out


def test_elastic_bf16_over_two_stages_learns(tmp_path):
    _, records = train_records(tmp_path, 2, *ELASTIC, "--pipeline-model-parallel-size", "2", "--epp-memory-budget", "0.002")
    assert any(m.elastic.num_chunks["split"] for m in records)


def test_stock_bf16_learns(tmp_path):
    out, _ = train_records(tmp_path, 2, *STOCK)
    assert "on cpu bf16 |" in out and "> layers: local spec" in out
