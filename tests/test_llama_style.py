"""``examples/llama_style.sh``: a LLaMA-style launch in Megatron-LM's flag names (SwiGLU, RMSNorm,
grouped-query attention 8:2, no biases, RoPE base 500000) with ``--elastic-pp`` at pp 2 on the
standard library's sources trains 20 steps with falling loss, and the planner's activation memory
equals the measured one on every step."""

from __future__ import annotations

import subprocess

from megatron_epp.training.metrics import read_metrics
from tests.launch import REPO, free_port, run_env


def test_llama_style_example_trains_with_falling_loss(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run(
        ["bash", str(REPO / "examples/llama_style.sh"), "--epp-metrics", str(metrics)], cwd=tmp_path,
        env=run_env({"MASTER_PORT": str(free_port())}), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert ("> architecture: SwiGLU MLP, RMSNorm (eps 1e-05), grouped-query attention 8:2, head dim 16, no biases, "
            "RoPE base 500000") in proc.stdout
    train = [m for m in read_metrics(metrics) if m.kind == "train"]
    assert [m.iteration for m in train] == list(range(1, 21))
    first, last = train[0].loss, sum(m.loss for m in train[-5:]) / 5
    assert last < 0.8 * first, f"loss {first} -> {last}"
    for m in train:  # the memory model counts SwiGLU, RMSNorm, GQA and no biases to the byte
        assert m.elastic.predicted_activation_bytes == m.elastic.measured_activation_bytes, m.iteration
