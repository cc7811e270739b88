"""pretrain_gpt.py with --bf16 on CPU: the elastic path (pp=1, the one-GPU layout, and pp=2) and the
stock path train, with finite and falling losses. Every --bf16 run on the first GPU died in the first
LayerNorm because the model was never cast (Float16Module now does it; tests/integration/test_gpu_readiness.py
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


# One stage (one GPU) slices and packs under Seq1F1B's plans: the elastic builder does not slice at pp=1 (every
# slice of a sequence stays live until its backward, so slicing saves no memory on one stage, only the recompute
# transient, and the CPU kernel's causal attention gains no time by it: it recomputes instead). Budgets checked
# in-process (megatron_epp.training.replay's sampler): pp=1 Seq1F1B k=4 at 2 MB: 12 of 12 steps split, 9 with a
# hybrid tail, 7 recompute; pp=2 elastic at 1.5 MB: 7 of 12 steps recompute.
def test_elastic_bf16_on_one_stage_splits_packs_and_learns(tmp_path):
    out, records = train_records(tmp_path, 1, *ELASTIC, "--pipeline-model-parallel-size", "1", "--epp-plan", "seq1f1b",
                                 "--epp-max-slices", "4", "--epp-memory-budget", "0.002")
    assert any(m.elastic.num_chunks["split"] for m in records) and any(m.elastic.num_chunks["hybrid"] for m in records)
    assert any(m.elastic.recomputed_layers for m in records)
    assert "on cpu bf16 |" in out
    assert "> layers: local spec + ElasticAttention" in out
    assert "> planner: --epp-profile auto: measured on CPU" in out


def test_elastic_bf16_over_two_stages_learns(tmp_path):
    _, records = train_records(tmp_path, 2, *ELASTIC, "--pipeline-model-parallel-size", "2", "--epp-memory-budget", "0.0015")
    assert all(m.elastic.plan.startswith("plan[") for m in records) and any(m.elastic.recomputed_layers for m in records)


def test_stock_bf16_learns(tmp_path):
    out, _ = train_records(tmp_path, 2, *STOCK)
    assert "on cpu bf16 |" in out and "> layers: local spec" in out
