"""pp=1, pp=2, pp=4, dp=2 x pp=2 and tp=2 with --sequence-parallel give the same loss and gradients on the same
batch and weights."""

from __future__ import annotations

import pytest
import torch

from tests.launch import torchrun
from tests.test_elastic_equivalence import rank0_shard

COMMON = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
          "--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--vocab-size", "256"]


def dump(tmp_path, name: str, nproc: int, *flags: str) -> tuple[float, dict[str, torch.Tensor]]:
    out = tmp_path / name
    out.mkdir()
    torchrun(nproc, "tests/workers/grad_dump.py", str(out), *COMMON, *flags)
    stages = [torch.load(p) for p in sorted(out.glob("stage*.pt"))]
    grads: dict[str, torch.Tensor] = {}
    for stage in reversed(stages):  # the first stage's tied embedding wins (it is the all-reduced one)
        grads.update(stage["grads"])
    return stages[-1]["loss"], grads


def assert_same(reference: tuple[float, dict], other: tuple[float, dict]) -> None:
    (ref_loss, ref), (loss, grads) = reference, other
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref.keys()
    for name, full in ref.items():
        g = rank0_shard(full, grads[name], name, gated=False)  # tensor-parallel rank 0's slice (itself without TP)
        rel = float((grads[name] - g).norm() / g.norm().clamp_min(1e-12))
        assert rel < 1e-5, f"{name}: relative gradient difference {rel:.2e}"


@pytest.mark.parametrize("position", ["rope", "learned_absolute"])
def test_pipeline_layouts_match_single_stage(tmp_path, position):
    flags = ["--position-embedding-type", position]
    reference = dump(tmp_path, "pp1", 1, *flags)
    assert reference[1]["embedding.word_embeddings.weight"].abs().sum() > 0
    assert_same(reference, dump(tmp_path, "pp2", 2, *flags, "--pipeline-model-parallel-size", "2"))
    if position == "rope":
        assert_same(reference, dump(tmp_path, "pp4", 4, *flags, "--pipeline-model-parallel-size", "4"))
        assert_same(reference, dump(tmp_path, "dp2pp2", 4, *flags, "--pipeline-model-parallel-size", "2"))
        # stock Megatron-Core's sequence parallelism on the local spec (TorchNorm: norm gradients summed over tp)
        assert_same(reference, dump(tmp_path, "tp2sp", 2, *flags, "--tensor-model-parallel-size", "2", "--sequence-parallel"))


def test_comparison_detects_a_different_batch(tmp_path):
    """The comparison is sharp: one changed sample (another seed) breaks it."""
    reference = dump(tmp_path, "a", 1)
    with pytest.raises(AssertionError):
        assert_same(reference, dump(tmp_path, "b", 2, "--pipeline-model-parallel-size", "2", "--seed", "7"))
