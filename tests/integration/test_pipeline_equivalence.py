"""pp=1, pp=2, pp=4, dp=2 x pp=2 and tp=2 with --sequence-parallel give the same loss and gradients on the same
batch and weights."""

from __future__ import annotations

import pytest
import torch

from tests.launch import torchrun
from tests.integration.test_elastic_equivalence import rank0_shard
from tests.workers.runs import RUN_SEPARATOR

COMMON = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
          "--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--vocab-size", "256"]
ROPE, LEARNED = ["--position-embedding-type", "rope"], ["--position-embedding-type", "learned_absolute"]
PP2, PP4 = ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4"]
# name: (processes, flags). The runs of one process count share a launch (tests/workers/grad_dump.py: one process
# start for several layouts, each on its own model-parallel groups).
RUNS = {
    "pp1-rope": (1, ROPE),
    "pp1-learned_absolute": (1, LEARNED),
    "pp2-rope": (2, [*ROPE, *PP2]),
    "pp2-learned_absolute": (2, [*LEARNED, *PP2]),
    # stock Megatron-Core's sequence parallelism on the local spec (TorchNorm: norm gradients summed over tp)
    "tp2sp-rope": (2, [*ROPE, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2-rope-seed7": (2, [*ROPE, *PP2, "--seed", "7"]),  # another batch
    "pp4-rope": (4, [*ROPE, *PP4]),
    "dp2pp2-rope": (4, [*ROPE, *PP2]),
}


def load(out) -> tuple[float, dict[str, torch.Tensor]]:
    stages = [torch.load(p) for p in sorted(out.glob("stage*.pt"))]
    grads: dict[str, torch.Tensor] = {}
    for stage in reversed(stages):  # the first stage's tied embedding wins (it is the all-reduced one)
        grads.update(stage["grads"])
    return stages[-1]["loss"], grads


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    """Every run of ``RUNS``: ``{name: (loss, gradients by global parameter name)}``, one launch per process count."""
    root = tmp_path_factory.mktemp("dumps")
    for nproc in sorted({n for n, _ in RUNS.values()}):
        argv: list[str] = []
        for name, (n, flags) in RUNS.items():
            if n == nproc:
                (root / name).mkdir()
                argv += [*([RUN_SEPARATOR] if argv else []), str(root / name), *COMMON, *flags]
        torchrun(nproc, "tests/workers/grad_dump.py", *argv)
    return {name: load(root / name) for name in RUNS}


def assert_same(reference: tuple[float, dict], other: tuple[float, dict]) -> None:
    (ref_loss, ref), (loss, grads) = reference, other
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref.keys()
    for name, full in ref.items():
        g = rank0_shard(full, grads[name], name, gated=False)  # tensor-parallel rank 0's slice (itself without TP)
        rel = float((grads[name] - g).norm() / g.norm().clamp_min(1e-12))
        assert rel < 1e-5, f"{name}: relative gradient difference {rel:.2e}"


@pytest.mark.parametrize("position", ["rope", "learned_absolute"])
def test_pipeline_layouts_match_single_stage(dumps, position):
    reference = dumps[f"pp1-{position}"]
    assert reference[1]["embedding.word_embeddings.weight"].abs().sum() > 0
    layouts = ["pp2", "pp4", "dp2pp2", "tp2sp"] if position == "rope" else ["pp2"]
    for layout in layouts:
        try:
            assert_same(reference, dumps[f"{layout}-{position}"])
        except AssertionError as error:
            raise AssertionError(f"{layout} differs from pp1 ({position}): {error}") from error


def test_comparison_detects_a_different_batch(dumps):
    """The comparison is sharp: one changed sample (another seed) breaks it."""
    with pytest.raises(AssertionError):
        assert_same(dumps["pp1-rope"], dumps["pp2-rope-seed7"])


def test_the_learned_position_runs_differ_from_rope(dumps):
    """The runs of one launch are their own: the position embedding each asked for was built (another loss)."""
    assert dumps["pp1-learned_absolute"][0] != dumps["pp1-rope"][0]
    assert "embedding.position_embeddings.weight" in dumps["pp1-learned_absolute"][1]
    assert "embedding.position_embeddings.weight" not in dumps["pp1-rope"][1]
