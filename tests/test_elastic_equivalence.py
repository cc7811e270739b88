"""Elastic 1F1B on random valid plans gives the loss and gradients of non-pipelined training.

The reference is stock Megatron-Core (local spec, no EPP) with every whole sequence as its own
micro-batch in one process. Random plans cover batched, split (1-8 slices) and hybrid chunks,
1-3 pipelines, pp 1/2/4, dp 2 x pp 2 and tp 2 x pp 2, tied embeddings, RoPE and learned positions:
38 plans.
Injected faults (prefix K/V dropped, the prefix K/V gradients later slices accumulate dropped, a
slice's K/V written at the wrong rows of its buffer, slices' backward in forward order, attention
leaking across packed sequences) must each break the match.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.launch import torchrun

MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64"]
CASES = 8


def run(out: Path, nproc: int, mode: str, cases: int, *flags: str) -> Path:
    out.mkdir()
    torchrun(nproc, "tests/workers/elastic_equivalence.py", str(out), "--mode", mode, "--cases", str(cases), *MODEL, *flags)
    return out


def load(out: Path, case: int) -> tuple[float, dict[str, torch.Tensor]]:
    stages = [torch.load(p) for p in sorted(out.glob(f"case{case}_stage*.pt"))]
    grads: dict[str, torch.Tensor] = {}
    for stage in reversed(stages):  # the first stage's (all-reduced) tied embedding wins
        grads.update(stage["grads"])
    return stages[-1]["loss"], grads


def tensor_parallel_shard(full: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """The slice of a full gradient that tensor-parallel rank 0 holds (same tensor without TP)."""
    for dim, (n, m) in enumerate(zip(full.shape, shard.shape)):
        if n != m:
            return full.chunk(n // m, dim)[0]
    return full


def worst_mismatch(reference: Path, elastic: Path, case: int) -> float:
    (ref_loss, ref), (loss, grads) = load(reference, case), load(elastic, case)
    assert grads.keys() == ref.keys()
    loss_rel = abs(loss - ref_loss) / abs(ref_loss)
    diffs = []
    for name, full in ref.items():
        g = tensor_parallel_shard(full, grads[name])
        diffs.append(float((grads[name] - g).norm() / g.norm().clamp_min(1e-12)))
    return max([loss_rel] + diffs)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reference")
    return {
        pos: run(root / pos, 1, "reference", CASES, "--position-embedding-type", pos)
        for pos in ("rope", "learned_absolute")
    }


@pytest.mark.parametrize(
    "nproc, pp, tp, cases, position",
    [(1, 1, 1, 8, "rope"), (2, 2, 1, 8, "rope"), (4, 4, 1, 6, "rope"), (4, 2, 1, 6, "rope"),
     (4, 2, 2, 4, "rope"), (2, 2, 1, 6, "learned_absolute")],
    ids=["pp1", "pp2", "pp4", "dp2xpp2", "tp2xpp2", "pp2-learned"],
)
def test_random_plans_match_reference(tmp_path, references, nproc, pp, tp, cases, position):
    elastic = run(tmp_path / "elastic", nproc, "elastic", cases, "--pipeline-model-parallel-size", str(pp),
                  "--tensor-model-parallel-size", str(tp), "--position-embedding-type", position)
    for case in range(cases):
        assert worst_mismatch(references[position], elastic, case) < 1e-5, f"case {case}"


def test_random_recompute_matches_reference(tmp_path, references):
    cases = 6
    elastic = run(tmp_path / "recompute", 2, "elastic", cases, "--pipeline-model-parallel-size", "2", "--random-recompute")
    for case in range(cases):
        assert worst_mismatch(references["rope"], elastic, case) < 1e-5, f"case {case}"


def test_recompute_with_dropout_replays_the_same_masks(tmp_path):
    """Dropout on: any recompute mix gives the gradients of the same plan without recompute."""
    cases, dropout = 4, ["--hidden-dropout", "0.2", "--attention-dropout", "0.2", "--pipeline-model-parallel-size", "2"]
    plain = run(tmp_path / "plain", 2, "elastic", cases, *dropout)
    recomputed = run(tmp_path / "recompute", 2, "elastic", cases, *dropout, "--random-recompute")
    for case in range(cases):
        assert worst_mismatch(plain, recomputed, case) < 1e-6, f"case {case}"
    unrestored = run(tmp_path / "no-rng", 2, "elastic", cases, *dropout, "--random-recompute",
                     "--fault", "recompute_without_rng_restore")
    assert max(worst_mismatch(plain, unrestored, c) for c in range(cases)) > 1e-3


@pytest.mark.parametrize("fault", ["drop_prefix", "drop_prefix_grads", "misplaced_kv", "forward_order_backward", "leak_packing"])
def test_injected_fault_breaks_the_match(tmp_path, references, fault):
    cases = 3
    broken = run(tmp_path / fault, 2, "elastic", cases, "--pipeline-model-parallel-size", "2", "--fault", fault)
    assert max(worst_mismatch(references["rope"], broken, c) for c in range(cases)) > 1e-2


def test_random_plans_cover_every_chunk_kind_and_shape():
    import numpy as np

    from megatron_epp.plan.order import max_chunks_per_sequence
    from tests.workers.random_plans import random_lengths, random_plan

    kinds, pipelines, slices = set(), set(), set()
    for case in range(CASES):
        lengths = random_lengths(np.random.default_rng([0, case]))
        plan = random_plan(np.random.default_rng([0, case, 0, 7]), lengths, 2, 2)
        kinds |= {k for k, n in plan.chunk_counts().items() if n}
        pipelines.add(len(plan.pipelines))
        slices |= {max_chunks_per_sequence(p) for p in plan.pipelines}
    assert kinds == {"batched", "split", "hybrid"} and pipelines == {1, 2, 3} and max(slices) >= 5
