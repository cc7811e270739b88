"""Activation offload in the executor (issue 41; docs/training.md, "Activation offload"), proven on CPU.

Gradients: random elastic plans (batched, split and hybrid chunks, random recompute per stage and chunk) at pp 2
(two processes, gloo) with random offloaded checkpoints (half of them every checkpointed layer's) equal the same
plans without offload bit for bit in fp32, LLaMA-style (SwiGLU, RMSNorm, GQA) and a GPT shape with both dropouts
(the recompute restores the RNG; the offload must not disturb it); planted faults (a checkpoint reloaded from
another one's host buffer; a reload whose copy is skipped) break the match. Memory (one process, one stage):
per plan the tracker's device activation peak with offload equals the memory walk's prediction to the byte, and
the host pool's peak equals the walk's host prediction; the gradients of each plan again bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launch import REPO, free_port, run_env, torchrun
from tests.workers.runs import RUN_SEPARATOR

MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--pipeline-model-parallel-size", "2"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2",
         "--disable-bias-linear", "--random-recompute"]
DROPOUT = ["--hidden-dropout", "0.2", "--attention-dropout", "0.2", "--random-recompute"]
CASES = 5
FAULT_CASES = 3
RUNS = {
    "llama": [*LLAMA], "llama-offload": [*LLAMA, "--offload"],
    "dropout": [*DROPOUT], "dropout-offload": [*DROPOUT, "--offload"],
    "wrong-slot": [*LLAMA, "--offload", "--offload-fault", "wrong-slot"],
    "skip-reload": [*LLAMA, "--offload", "--offload-fault", "skip-reload"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every run of RUNS in one launch of two processes (pp 2): ``out/NAME/case{i}_stage{p}.pt``."""
    out = tmp_path_factory.mktemp("offload")
    argv: list[str] = []
    for name, flags in RUNS.items():
        (out / name).mkdir()
        cases = FAULT_CASES if "--offload-fault" in flags else CASES
        argv += [*([RUN_SEPARATOR] if argv else []), str(out / name), "--mode", "elastic", "--cases", str(cases), *MODEL, *flags]
    torchrun(2, "tests/workers/elastic_equivalence.py", *argv, timeout=600)
    return out


def stages(out: Path, case: int) -> list[dict]:
    return [torch.load(out / f"case{case}_stage{p}.pt") for p in range(2)]


def same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b


def bitwise_equal(a: list[dict], b: list[dict]) -> bool:
    """Every stage's loss (the last stage's; None elsewhere) and gradients, bit for bit."""
    return all(same(x["loss"], y["loss"]) and x["grads"].keys() == y["grads"].keys()
               and all(torch.equal(x["grads"][n], y["grads"][n]) for n in x["grads"]) for x, y in zip(a, b, strict=True))


def offloads(saved: list[dict], least: int) -> bool:
    """Whether the case's plan offloads at least ``least`` checkpoints of some chunk on some stage."""
    plan = json.loads(saved[0]["plan"]) if isinstance(saved[0]["plan"], str) else saved[0]["plan"]
    return any(max(map(max, p.get("offload", [[0]]))) >= least for p in plan["pipelines"])


@pytest.mark.parametrize("shape", ["llama", "dropout"])
def test_offloaded_plans_give_the_same_gradients_bit_for_bit(runs, shape):
    plain_any = False
    for case in range(CASES):
        plain, offloaded = stages(runs / shape, case), stages(runs / f"{shape}-offload", case)
        assert plain[0]["plan"] != offloaded[0]["plan"] or not offloads(offloaded, 1)
        assert bitwise_equal(plain, offloaded), f"{shape} case {case}: gradients differ with offload"
        # the offload happened: the host pool held a checkpoint on every stage whose plan offloads one
        assert all((s["host_peak"] > 0) == any(any(row[p]) for row in [q.get("offload", [[0] * 2] * 2)
                                                                         for q in json.loads(s["plan"])["pipelines"]])
                   for p, s in enumerate(offloaded))
        plain_any |= offloads(offloaded, 2)
    assert plain_any, "no plan offloaded two checkpoints of a chunk: the test proves less than it says"


@pytest.mark.parametrize("fault, least", [("wrong-slot", 2), ("skip-reload", 1)])
def test_planted_offload_faults_break_the_match(runs, fault, least):
    """A case whose plan the fault can touch (two offloaded checkpoints of a chunk for a wrong slot, one for a skipped
    reload) must differ from the same plan without offload; at least one case must."""
    touched = 0
    for case in range(FAULT_CASES):
        faulty, plain = stages(runs / fault, case), stages(runs / "llama", case)
        if offloads(faulty, least):
            touched += 1
            assert not bitwise_equal(plain, faulty), f"{fault}: case {case} unchanged"
    assert touched


SHAPES = {
    "h32": ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2"],
    "llama-dropout": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--kv-channels", "16",
                      "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size", "96",
                      "--normalization", "RMSNorm", "--disable-bias-linear", "--hidden-dropout", "0.2", "--attention-dropout", "0.1"],
}


@pytest.fixture(scope="module")
def memory(tmp_path_factory) -> dict[str, list[dict]]:
    """tests/workers/memory_chunks.py --offload on every shape of SHAPES, in one process."""
    out = tmp_path_factory.mktemp("offload-memory")
    argv: list[str] = []
    for name, flags in SHAPES.items():
        argv += [*([RUN_SEPARATOR] if argv else []), str(out / f"{name}.json"), "--offload", *flags]
    env = run_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    proc = subprocess.run([sys.executable, str(REPO / "tests/workers/memory_chunks.py"), *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in SHAPES}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_device_and_host_peaks_match_the_walk_to_the_byte(memory, shape):
    rows = memory[shape]
    assert len(rows) == 10 and all(any(r["offload"]) for r in rows)
    bad = [r for r in rows if r["pred"] != r["meas"] or r["pred_host"] != r["meas_host"] or r["meas_host"] <= 0]
    assert not bad, "\n".join(f"{r['case']} rc={r['rc']} offload={r['offload']}: device {r['pred']:.0f} predicted, "
                               f"{r['meas']} measured; host {r['pred_host']:.0f} predicted, {r['meas_host']} measured" for r in bad)
    assert all(r["bitwise"] for r in rows), [r for r in rows if not r["bitwise"]]


def test_offload_lowers_the_device_peak(memory):
    """Full recompute with every checkpoint offloaded holds less on the device than a chunk's one offloaded checkpoint."""
    rows = {(r["case"], tuple(r["offload"])): r for r in memory["h32"]}
    assert rows["batched", (4,)]["meas"] < rows["batched", (1,)]["meas"]
