"""The planner's model-state term (weights, gradients, optimizer states per rank) equals the bytes of
the tensors Megatron-Core allocates, with and without ``--use-distributed-optimizer``, fp32 and bf16,
pp 2 and tp 2 (tied embeddings across stages, learned positions)."""

from __future__ import annotations

import json

import pytest

from tests.launch import torchrun

MODEL = ["--elastic-pp", "--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "64", "--global-batch-size", "4", "--epp-memory-budget", "1"]


LAYOUTS = {
    "pp2-fp32": ["--pipeline-model-parallel-size", "2"],
    "tp2-bf16-learned": ["--tensor-model-parallel-size", "2", "--bf16", "--position-embedding-type", "learned_absolute"],
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def records(request, tmp_path_factory) -> dict[str, list[dict]]:
    """Every rank's records of a layout (4 ranks: dp 2), ``plain`` and ``sharded`` (--use-distributed-optimizer),
    from one launch shared by the tests below."""
    out = tmp_path_factory.mktemp(request.param) / "states.json"
    torchrun(4, "tests/workers/model_state.py", str(out), *MODEL, *LAYOUTS[request.param], timeout=180)
    return json.loads(out.read_text())


def test_model_states_predicted_byte_for_byte(records):
    for r in records["plain"]:
        assert r["weight"] + r["grad"] + r["optim"] == r["predicted"], r


def test_distributed_optimizer_states_divided_over_data_parallel(records):
    """The optimizer's states (and bf16's fp32 main params) are sharded over dp = 2: together the two data-parallel
    ranks of a stage hold what the prediction gives them; each holds its half up to where the parameters' boundaries
    cut the shards (megatron-core aligns parameters in the shared buffer)."""
    plain = {(r["pp"], r["tp"], r["dp"]): r for r in records["plain"]}
    sharded = records["sharded"]
    assert {r["dp"] for r in sharded} == {0, 1}
    for r in sharded:
        full = plain[r["pp"], r["tp"], r["dp"]]
        assert (r["weight"], r["grad"]) == (full["weight"], full["grad"])
        predicted_optim = r["predicted"] - r["weight"] - r["grad"]
        assert predicted_optim == full["optim"] / 2
        assert abs(r["optim"] - predicted_optim) <= 0.01 * r["predicted"], r
    for pp, tp in {(r["pp"], r["tp"]) for r in sharded}:
        group = [r for r in sharded if (r["pp"], r["tp"]) == (pp, tp)]
        assert sum(r["optim"] for r in group) == sum(r["predicted"] - r["weight"] - r["grad"] for r in group)
