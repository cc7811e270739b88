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


def launch(out: Path, runs: dict[str, list[str]]) -> Path:
    """Every run of ``runs`` in one launch of two processes (pp 2): ``out/NAME/case{i}_stage{p}.pt``; a run with a
    planted fault has FAULT_CASES cases, the others CASES."""
    argv: list[str] = []
    for name, flags in runs.items():
        (out / name).mkdir()
        cases = FAULT_CASES if any(f.endswith("-fault") for f in flags) else CASES
        argv += [*([RUN_SEPARATOR] if argv else []), str(out / name), "--mode", "elastic", "--cases", str(cases), *MODEL, *flags]
    torchrun(2, "tests/workers/elastic_equivalence.py", *argv, timeout=600)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every run of RUNS (offloaded checkpoints)."""
    return launch(tmp_path_factory.mktemp("offload"), RUNS)


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


KV_RUNS = {
    "llama-kv-host": [*LLAMA, "--kv-host"], "llama-kv-host-offload": [*LLAMA, "--kv-host", "--offload"],
    **{fault: [*LLAMA, "--kv-host", "--kv-host-fault", fault] for fault in ("kv-wrong-rows", "kv-skip-write", "kv-skip-accumulate")},
}


@pytest.fixture(scope="module")
def kv_runs(tmp_path_factory) -> Path:
    """Every run of KV_RUNS (split sequences' K/V buffers on the host)."""
    return launch(tmp_path_factory.mktemp("kv-host"), KV_RUNS)


def kv_host_chunks(saved: list[dict]) -> tuple[int, int]:
    """``(slices, hybrid)``: of the case's chunks, how many are slices of a sequence on the host, and how many of those
    are hybrid chunks (a slice packed with whole sequences) with a prefix."""
    plan = json.loads(saved[0]["plan"]) if isinstance(saved[0]["plan"], str) else saved[0]["plan"]
    slices = hybrid = 0
    for pipe in plan["pipelines"]:
        host = set(pipe.get("kv_host", []))
        for chunk in pipe["chunks"]:
            mine = [s for s in chunk["segments"] if s["seq"] in host]
            slices += bool(mine)
            hybrid += bool(mine) and len(chunk["segments"]) > 1 and mine[0]["start"] > 0
    return slices, hybrid


@pytest.mark.parametrize("name", ["llama-kv-host", "llama-kv-host-offload"])
def test_kv_host_plans_give_the_same_gradients_bit_for_bit(runs, kv_runs, name):
    """K/V buffers on the host (with and without offloaded checkpoints) against the same plans with them on the device;
    the cases together put split and hybrid chunks' K/V on the host, and the host pool held them."""
    slices = hybrid = 0
    for case in range(CASES):
        plain, host = stages(runs / "llama", case), stages(kv_runs / name, case)
        assert bitwise_equal(plain, host), f"{name} case {case}: gradients differ with the K/V buffers on the host"
        n, h = kv_host_chunks(host)
        slices, hybrid = slices + n, hybrid + h
        assert not n or all(s["host_peak"] > 0 for s in host)
    assert slices >= 6 and hybrid >= 1, (slices, hybrid)


@pytest.mark.parametrize("fault", ["kv-wrong-rows", "kv-skip-write", "kv-skip-accumulate"])
def test_planted_kv_host_faults_break_the_match(runs, kv_runs, fault):
    """A prefix fetched from the wrong rows, a write-back skipped, a gradient accumulation skipped: every case whose
    plan has a sequence on the host in two slices or more differs from the same plan on the device; one must."""
    touched = 0
    for case in range(FAULT_CASES):
        faulty, plain = stages(kv_runs / fault, case), stages(runs / "llama", case)
        if kv_host_chunks(faulty)[0] >= 2:
            touched += 1
            assert not bitwise_equal(plain, faulty), f"{fault}: case {case} unchanged"
    assert touched


SHAPES = {
    "h32": ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2"],
    "llama-dropout": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--kv-channels", "16",
                      "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size", "96",
                      "--normalization", "RMSNorm", "--disable-bias-linear", "--hidden-dropout", "0.2", "--attention-dropout", "0.1"],
}


def memory_runs(out: Path, mode: str, shapes: dict[str, list[str]]) -> dict[str, list[dict]]:
    """tests/workers/memory_chunks.py ``mode`` (``--offload``, ``--kv-host``) on every shape of ``shapes``, in one process."""
    argv: list[str] = []
    for name, flags in shapes.items():
        argv += [*([RUN_SEPARATOR] if argv else []), str(out / f"{name}.json"), mode, *flags]
    env = run_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    proc = subprocess.run([sys.executable, str(REPO / "tests/workers/memory_chunks.py"), *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in shapes}


@pytest.fixture(scope="module")
def memory(tmp_path_factory) -> dict[str, list[dict]]:
    return memory_runs(tmp_path_factory.mktemp("offload-memory"), "--offload", SHAPES)


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


KV_SHAPES = {
    "h32": SHAPES["h32"],
    "llama-hidden-dropout": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--kv-channels", "16",
                             "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size", "96",
                             "--normalization", "RMSNorm", "--disable-bias-linear", "--hidden-dropout", "0.2"],
}


@pytest.fixture(scope="module")
def kv_memory(tmp_path_factory) -> dict[str, list[dict]]:
    return memory_runs(tmp_path_factory.mktemp("kv-host-memory"), "--kv-host", KV_SHAPES)


@pytest.mark.parametrize("shape", list(KV_SHAPES))
def test_kv_host_device_and_host_peaks_match_the_walk_to_the_byte(kv_memory, shape):
    """Per plan with K/V buffers on the host (alone and with offloaded checkpoints): the device activation peak equals
    the walk's to the byte, also with the K/V gradient accumulators counted (window slots against ``kv_grad`` 1); the
    host pool's peak equals the walk's host prediction, also with its accumulators; the gradients bit for bit."""
    rows = kv_memory[shape]
    assert len(rows) == 12 and all(r["kv_host"] for r in rows) and sum(any(r["offload"]) for r in rows) >= 4
    keys = [("pred", "meas"), ("pred_grads", "meas_grads"), ("pred_host", "meas_host"), ("pred_host_grads", "meas_host_grads")]
    bad = [(r["case"], r["rc"], r["offload"], {m: (r[p], r[m]) for p, m in keys if r[p] != r[m]}) for r in rows
           if any(r[p] != r[m] for p, m in keys) or r["meas_host"] <= 0 or r["meas_host_grads"] <= r["meas_host"]]
    assert not bad, "\n".join(map(str, bad))
    assert all(r["bitwise"] for r in rows), [r["case"] for r in rows if not r["bitwise"]]


def test_kv_host_lowers_the_device_peak(kv_memory):
    """A long split sequence without recompute holds its 2-block window on the device, not its whole K/V buffer."""
    rows = [r for r in kv_memory["h32"] if r["case"] in ("split", "long-first-slice") and not any(r["offload"])]
    assert rows and all(r["meas"] < r["meas_device_kv"] for r in rows)


def test_training_with_offload_measures_the_host_link_at_start_up():
    """pretrain_gpt.py --epp-offload checkpoints on two CPU ranks: both measure the copy bandwidth at once at start-up
    (the minimum over the two), the start-up line says it, and the run trains on it."""
    import re

    from tests.launch import torchrun as launch

    out = launch(2, "pretrain_gpt.py", "--elastic-pp", "--mock-data", "--pipeline-model-parallel-size", "2", "--num-layers", "2",
                 "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "128", "--global-batch-size", "2",
                 "--train-iters", "1", "--log-interval", "1", "--epp-offload", "checkpoints").stdout
    line = re.search(r"^> host link: measured [\d.]+ GB/s out, [\d.]+ back \(host to host into the CPU executor's pool "
                     r"and back, one after the other, 2 local ranks; median of [1-5] x 64 MiB, the minimum over 2 ranks\), "
                     r"host memory [\d.]+ GB, budget [\d.]+ GB per rank \(75% of it over the local ranks\)$", out, re.M)
    assert line, out[-3000:]
    assert re.search(r"^ iteration +1/", out, re.M), out[-3000:]
