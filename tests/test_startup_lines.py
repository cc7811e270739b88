"""What pretrain_gpt.py says at start-up about the planner's limits (in-process: the flags as parsed)."""

from __future__ import annotations

import pytest

from megatron_epp.training.arguments import parse_args
from megatron_epp.training.main import dropout_memory_warning

BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
        "--global-batch-size", "4", "--pipeline-model-parallel-size", "1"]


@pytest.mark.parametrize("flags, says", [
    (["--elastic-pp"], None),
    (["--elastic-pp", "--hidden-dropout", "0.1"], "--hidden-dropout 0.1"),
    (["--elastic-pp", "--attention-dropout", "0.2"], "--attention-dropout 0.2"),
    (["--hidden-dropout", "0.1", "--attention-dropout", "0.1"], None),  # the stock path has no memory planner
])
def test_dropout_under_elastic_pp_warns_that_its_memory_is_not_counted(monkeypatch, flags, says):
    monkeypatch.setenv("WORLD_SIZE", "1")
    warning = dropout_memory_warning(parse_args([*BASE, *flags]))
    if says is None:
        assert warning is None
    else:
        assert warning.startswith(f"warning: {says}") and "counts no dropout tensors" in warning and "\n" not in warning
