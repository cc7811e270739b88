"""``examples/long_context_sft.sh`` end to end on a CPU: a tiny Qwen2 and its tokenizer made by the script, imported at
pp 2, fine-tuned on conversations at 4x its context (linear RoPE scaling) with the loss on the assistant's tokens, with
split chunks in its plans, exported as a Qwen2 with its tokenizer, and loaded by ``transformers``, whose tokenizer
renders a conversation as training did."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

pytest.importorskip("transformers")

from megatron_epp.training.metrics import read_metrics  # noqa: E402
from tests.launch import REPO, free_port, run_env  # noqa: E402


def test_long_context_sft_example(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run(["bash", str(REPO / "examples/long_context_sft.sh"), "--train-iters", "4", "--epp-metrics", str(metrics)],
                          cwd=REPO, env=run_env({"WORK": str(tmp_path), "MASTER_PORT": str(free_port())}), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "--add-qkv-bias" in re.search(r"^> pretrain_gpt\.py .*$", out, re.MULTILINE).group(0)
    assert "context 256 -> 1024 tokens" in out and "--sft: the loss on the assistant's tokens" in out
    train = [m for m in read_metrics(metrics) if m.kind == "train"]
    assert [m.iteration for m in train] == [1, 2, 3, 4] and any(m.elastic.num_chunks["split"] for m in train)
    assert re.search(r"> exported iteration 4 .*: Qwen2ForCausalLM, .* the tokenizer's tokenizer\.json, tokenizer_config\.json, "
                     r"chat_template\.jinja", out)
    assert json.loads((tmp_path / "hf-long" / "config.json").read_text())["rope_parameters"] == {
        "rope_theta": 1000000.0, "rope_type": "linear", "factor": 4.0}
    assert re.search(r"> transformers loads .*: Qwen2ForCausalLM, context 1024, .* renders the first conversation as training "
                     r"did \(\d+ tokens\): loss \d+\.\d+ on its \d+ assistant tokens", out)
