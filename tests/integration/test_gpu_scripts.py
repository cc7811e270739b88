"""The GPU scripts on CPU: what can be checked before device time is spent.

* ``check_cuda_attention.py`` without flash-attn checks torch's varlen and the SDPA paths and reports flash as skipped
  (it used to exit 2); without CUDA, outside its dry run, it refuses with one line;
* ``profile_gpu.py --device cpu`` on a tiny grid writes a profile the planner loads, marked measured
  on this CPU, with its fit errors, and ``epp-plan`` plans on it;
* ``gpu_check.sh`` refuses without CUDA (one line), lists its steps with ``--dry-run`` (the equivalence
  step's one-process selection, the bench step), and its ``--cpu-rehearsal`` runs the attention check, the
  profiler and the bf16 pp=1 training end to end;
* ``check_cuda_attention.py``'s fp32 reference (query blocks, checkpointed) equals the masked reference and
  builds no mask larger than a block; on CUDA it runs no ``sdpa-masked`` (``main`` on a pretend CUDA device); its
  saved-bytes measure sees K/V expanded to the query heads and counts their bytes, and the aten-flash path saves none;
* the equivalence fixture skips the runs of more processes than GPUs, with the reason, and launches the rest;
* ``bench_gpu.py --dry-run`` lists its cells, budgets and commands; its JSON from step records pairs steps by
  iteration and takes medians;
* ``gpu_check.sh --quick`` fits one device command: its steps' limits sum to at most 480 s, its training run takes
  the default path (no ``--epp-profile``, no ``--epp-memory-budget``), its bench cell runs that model and cap; its CPU
  rehearsal trains on that path and ends with the report's JSON line (``gpu_check_report.py``), per step the memory
  against the budget.
"""

from __future__ import annotations

import gzip
import importlib
import json
import subprocess
import sys

import pytest
import torch

from megatron_epp.cost.activation_memory import saved_tensor_memory
from megatron_epp.cost.profile_lookup import load_profile
from megatron_epp.training.metrics import ElasticMetrics, StepMetrics
from tests.launch import REPO, run_env


def run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=timeout)


def test_attention_check_without_flash_runs_sdpa_and_reports_flash_skipped():
    proc = run(sys.executable, "-m", "benchmarks.check_cuda_attention", "--cpu-dry-run", "--without-flash", "--without-fa4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("flash-varlen  skipped (--without-flash)") == 3  # batched, split x4, hybrid
    assert out.count("fa4-varlen    skipped (--without-fa4)") == 3
    assert out.count("  sdpa-causal ") == 3 and out.count("  sdpa-masked ") == 3 and out.count("  torch-varlen ") == 3
    assert "PASS: torch-varlen and SDPA paths match fp32; fa4-varlen skipped (--without-fa4); flash-varlen skipped (--without-flash)" in out
    # torch-varlen as on the GPUs' torch 2.11 (no enable_gqa): GQA through the aten flash ops, K/V not expanded
    assert "varlen_attn of torch reference (GQA: aten-flash)" in out
    saved = [line for line in out.splitlines() if line.startswith("saved bytes per layer: torch-varlen ")]
    assert len(saved) == 1 and "(K/V heads not expanded: yes) on split x4, GQA mode aten-flash" in saved[0], saved
    refused = run(sys.executable, "-m", "benchmarks.check_cuda_attention")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "check_cuda_attention: no CUDA device (use --cpu-dry-run to check the script on CPU)"]


def test_gpu_profiler_smoke_run_on_cpu_makes_a_profile_the_planner_reads(tmp_path):
    out = tmp_path / "profile.json"
    llama = ("--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
             "--disable-bias-linear", "--kv-channels", "16", "--rotary-base", "500000")  # pretrain_gpt.py's flags
    proc = run(sys.executable, "-m", "megatron_epp.measure.profile_gpu", "--device", "cpu", "--hidden-size", "32", "--num-attention-heads", "4",
               "--vocab-size", "64", "--seq-lengths", "16,32,64", "--contexts", "0,32", "--layer-lengths", "16,32,64",
               "--head-lengths", "16,64", "--warmup", "1", "--repeats", "2", *llama, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    profile = load_profile(str(out))
    assert profile.source == "measured" and profile.device.startswith("CPU ") and "sdpa-merged" in profile.device
    shape = profile.model  # the LLaMA layer as pretrain_gpt.py builds it (its FFN default, its padded vocabulary)
    assert (shape.hidden, shape.num_kv_heads, shape.head_dim, shape.swiglu, shape.normalization, shape.bias) == (32, 2, 16, True, "RMSNorm", False)
    assert shape.vocab == 128 and shape.dtype == "float32" and profile.time_model == shape
    assert "4 heads, 2 K/V heads x 16, ffn 64 SwiGLU, RMSNorm, no biases" in proc.stdout
    # at this toy size launch overhead dominates and a term may fit to 0: finite and non-negative is what holds
    coefficients = [v for t in (profile.fwd, profile.bwd, profile.recompute, profile.head_fwd, profile.head_bwd) for v in t.vector()]
    assert all(0 <= v < float("inf") for v in coefficients) and profile.fwd.b1 + profile.fwd.a2 > 0
    assert set(profile.fit["errors"]) == {"attention_fwd", "attention_bwd", "fwd", "bwd", "recompute", "head_fwd", "head_bwd"}
    assert profile.fit["errors"]["attention_fwd"]["points"] == 6 and "rms rel err" in proc.stdout
    # the memory it measured, printed and stored (on the CPU: what autograd saves, equal to the saved-tensor count)
    m, counted = profile.memory, saved_tensor_memory(shape)
    assert (m.derive, m.act_token, m.ckpt_token, m.logits_token) == ("measured", counted["act_token"], counted["ckpt_token"], counted["logits_token"])
    assert (f"  memory (measured, saved-tensors basis): act_token {m.act_token:,.1f} B (0.00 % rms), ckpt_token {m.ckpt_token:,.1f} B "
            f"(0.00 % rms), logits_token {m.logits_token:,.1f} B (0.00 % rms) per token; bwd_workspace 0.000 layers, kv_grad 0") in proc.stdout
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed["memory"] == {"act_token": m.act_token, "ckpt_token": m.ckpt_token, "logits_token": m.logits_token, "bwd_workspace": 0.0}
    lengths = tmp_path / "lengths.txt.gz"
    with gzip.open(lengths, "wt") as f:
        f.write("\n".join(map(str, [300, 100, 40, 20] * 4)) + "\n")
    plan = run(sys.executable, "-m", "megatron_epp.planner", str(lengths), "--epp-profile", str(out), "--stages", "2", "--tp", "1",
               "--max-seq-len", "512", "--epp-memory-budget", "1", "--baselines", "", "--json")
    assert plan.returncode == 0, plan.stderr
    summary = json.loads(plan.stdout.strip().splitlines()[-1])
    assert summary["profile_source"] == "measured" and summary["device"] == profile.device
    bad = run(sys.executable, "-m", "megatron_epp.measure.profile_gpu", "--out", str(tmp_path / "x.json"))  # --device cuda here
    assert bad.returncode == 2 and "--device cuda: torch.cuda.is_available() is False" in bad.stderr
    for flags, message in ((["--num-query-groups", "3", "--group-query-attention"], "not divisible by --num-query-groups 3"),
                           (["--elastic-pp"], "--elastic-pp: not a flag of this script nor a model flag of pretrain_gpt.py")):
        bad = run(sys.executable, "-m", "megatron_epp.measure.profile_gpu", "--device", "cpu", *flags, "--out", str(tmp_path / "x.json"))
        last = bad.stderr.strip().splitlines()[-1]  # argparse's usage, then one error line
        assert bad.returncode == 2 and last.startswith("epp-profile-gpu: error: ") and message in last and bad.stderr.count("error") == 1, bad.stderr


def test_gpu_check_refuses_without_cuda_and_lists_its_steps():
    refused = run("bash", "scripts/gpu_check.sh")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()] and "gpu_check.sh: error: no CUDA device" in refused.stderr
    dry = run("bash", "scripts/gpu_check.sh", "--dry-run", "--out", "/tmp/x")
    assert dry.returncode == 0
    steps = [line.split()[0] for line in dry.stdout.splitlines()[1:-1]]
    assert steps == ["facts", "install", "attention", "equivalence", "fused", "profile", "train", "bench"]
    assert dry.stdout.splitlines()[-1] == "limits: 2250 s in all"
    assert "setup_gpu.sh --wheels" in dry.stdout and "-rs tests/integration/test_elastic_equivalence.py -k pp1" in dry.stdout
    bench = next(line for line in dry.stdout.splitlines() if line.split()[0] == "bench")
    assert "(limit  600 s)" in bench and bench.rstrip().endswith("-m benchmarks.bench_gpu")  # as a user runs it: no flags
    rehearsal = run("bash", "scripts/gpu_check.sh", "--cpu-rehearsal", "--dry-run", "--steps", "bench")
    assert rehearsal.stdout.splitlines()[1].rstrip().endswith("-m benchmarks.bench_gpu --dry-run --cells mock:16384")
    bad = run("bash", "scripts/gpu_check.sh", "--steps", "facts,warp")
    assert bad.returncode == 2 and "unknown step 'warp'" in bad.stderr


def test_gpu_check_cpu_rehearsal_runs_its_steps_end_to_end(tmp_path):
    out = tmp_path / "check"
    proc = run("bash", "scripts/gpu_check.sh", "--cpu-rehearsal", "--steps", "attention,profile,train", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary[1:]] == ["attention", "profile", "train"]
    assert all(line.split()[1] == "ok" for line in summary[1:]), summary
    assert "PASS" in summary[1] and "train: ok" in summary[3] and "split chunks" in summary[3]
    assert load_profile(str(out / "profile.json")).source == "measured"
    assert f"--epp-profile {out / 'profile.json'}" in (out / "train.log").read_text()  # trained on the profile just made


def test_attention_check_runs_no_masked_sdpa_on_cuda(monkeypatch, capsys):
    """On CUDA the check runs the varlen kernels and sdpa-causal, never sdpa-masked (a CPU path: in bf16 with GQA its
    mask sends SDPA to the math kernel, whose scores of every head ran an H100 out of memory); the CPU dry run keeps it.
    ``main`` as on a CUDA machine (the device said to be CUDA, each layout's work replaced by a recorder): the backends
    every layout is given."""
    from megatron_epp.executor import kernels
    from benchmarks.attention_harness import REFERENCE_KERNEL, reference_torch_varlen

    check = importlib.import_module("benchmarks.check_cuda_attention")
    assert check.backends_for("cuda") == ("fa4-varlen", "flash-varlen", "torch-varlen", "sdpa-causal")
    assert "sdpa-masked" not in check.backends_for("cuda") and check.backends_for("cpu")[-1] == "sdpa-masked"
    given = []

    def check_layout(name, plan, attention, args, backends, device, dtype, until):
        given.append((name, device, backends))
        return {b: dict.fromkeys(("out", "dq", "dk", "dv"), 0.0) for b in backends}, {b: (1.0, 0.0, 1) for b in backends}, None

    monkeypatch.setattr(kernels, "select_backend", kernels.select_backend)  # main's force() replaces it: restored after
    monkeypatch.setattr(check, "setup", lambda args: ("cuda", torch.bfloat16))
    monkeypatch.setattr(kernels, "load_flash_kernel", lambda: (REFERENCE_KERNEL, ""))  # both varlen kernels there
    monkeypatch.setattr(kernels, "load_torch_varlen", lambda: (reference_torch_varlen("aten-flash"), ""))
    monkeypatch.setattr(kernels.fa4, "load_kernel", lambda: (None, "flash-attn-4 does not import (test)"))
    monkeypatch.setattr(check, "check_layout", check_layout)
    monkeypatch.setattr(check, "saved_line", lambda *args: ("saved bytes per layer: (recorded run)", True))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "pretend GPU")
    assert check.main([]) == 0
    assert given == [(name, "cuda", check.backends_for("cuda")[1:]) for name in ("batched", "split x4", "hybrid")], given
    assert "backends flash-varlen, torch-varlen, sdpa-causal;" in capsys.readouterr().out


def test_attention_check_saved_bytes_see_expanded_kv(monkeypatch):
    """The check's saved-bytes measure (``saved_per_layer``) on the split layout with GQA 4:2: the aten-flash path saves
    the K/V at their width (the K/V buffer once, 2 x 256 rows x 2 heads x 8 x 4 bytes) and no expanded copy; with the K/V
    heads expanded (the last resort; a reference ``varlen_attn`` that saves what torch's does) it sees them, and counts
    their bytes (4 heads, 64 + 128 + 192 + 256 rows, K and V) in place of the buffer's."""
    from megatron_epp.executor import kernels
    from benchmarks.attention_harness import make_attention, random_tensors, reference_torch_varlen, reference_varlen_attn_saving_as_torch

    check = importlib.import_module("benchmarks.check_cuda_attention")
    monkeypatch.setattr(kernels, "select_backend", kernels.select_backend)  # the script's force() replaces it: restored after
    plan = check.layouts(64)["split x4"]
    saved = {}
    for gqa in ("aten-flash", "expanded"):
        kernel = reference_torch_varlen(gqa, func=reference_varlen_attn_saving_as_torch if gqa == "expanded" else None)
        monkeypatch.setattr(kernels, "load_torch_varlen", lambda kernel=kernel: (kernel, ""))
        tensors = random_tensors(plan, 4, 2, 8, torch.float32, "cpu", seed=0)
        saved[gqa] = check.saved_per_layer(make_attention(4, 2, 8), plan, tensors, "cpu", heads=4)
    assert saved["aten-flash"][1] is True and saved["expanded"][1] is False
    rows = 64 + 128 + 192 + 256
    queries_outputs_lse = 4 * (2 * 64 * 4 * 8 * 4 + 4 * 64 * 4 + 16)  # per slice: q, out, lse, the rng state
    assert saved["aten-flash"][0] == queries_outputs_lse + 2 * 256 * 2 * 8 * 4, saved  # the K/V buffer, once
    assert saved["expanded"][0] == queries_outputs_lse + 2 * rows * 4 * 8 * 4, saved  # the expanded copies, not the buffer


def test_blocked_fp32_reference_equals_the_masked_one_and_builds_no_mask_beyond_a_block(monkeypatch):
    from megatron_epp.executor import context, kernels
    from benchmarks.attention_harness import make_attention, random_tensors, run_plan, worst_errors

    check = importlib.import_module("benchmarks.check_cuda_attention")
    monkeypatch.setattr(kernels, "select_backend", kernels.select_backend)  # the script's force() replaces it: restored after
    heads, kv_heads, dim, block = 4, 2, 8, 2**11
    built, whole, real = [], [], context.bottom_right_causal_mask
    monkeypatch.setattr(check, "bottom_right_causal_mask", lambda s, c, device: built.append((s, c)) or real(s, c, device))
    monkeypatch.setattr(context, "bottom_right_causal_mask", lambda s, c, device="cpu": whole.append((s, c)) or real(s, c, device))
    attention = make_attention(heads, kv_heads, dim)
    for name, plan in check.layouts(64).items():  # slices of 64 tokens: up to 64 x 256 keys per segment
        tensors = random_tensors(plan, heads, kv_heads, dim, torch.float32, "cpu", seed=1)
        built.clear()
        whole.clear()
        reference = check.run_reference(attention, plan, tensors, "cpu", block_elements=block)
        assert not whole, f"{name}: the reference built a whole segment's mask {whole}"
        assert built and all(s * (c + s) * heads <= block for s, c in built), (name, built)  # scores (and mask) per block
        check.force("sdpa-masked")
        errors = worst_errors(run_plan(attention, plan, tensors, "cpu"), reference)
        assert max(errors.values()) < 1e-5, (name, errors)
        if name == "split x4":  # the last slice (64 queries over 192 prefix keys) ran in blocks of 2 rows
            assert (2, 254) in built and check.reference_block_rows(256, heads, block) == 2
    # the reference is exact attention: a wrong block mask (one key too many) is caught
    monkeypatch.setattr(check, "bottom_right_causal_mask", lambda s, c, device: real(s, c + 1, device)[:, :-1])  # each query sees the next key
    plan = check.layouts(64)["split x4"]
    tensors = random_tensors(plan, heads, kv_heads, dim, torch.float32, "cpu", seed=1)
    leaky = check.run_reference(attention, plan, tensors, "cpu", block_elements=block)
    check.force("sdpa-masked")
    assert max(worst_errors(leaky, run_plan(attention, plan, tensors, "cpu")).values()) > 1e-3


def test_equivalence_fixture_skips_runs_of_more_processes_than_gpus(monkeypatch, tmp_path):
    from megatron_epp.model import runtime as initialize
    from tests.integration import test_elastic_equivalence as equivalence

    launched = []
    monkeypatch.setattr(equivalence.Runs, "launch", lambda self, nproc: launched.append(nproc) or None)
    monkeypatch.setattr(initialize, "gpu_count", lambda: 1)  # one GPU
    runs = equivalence.Runs(tmp_path, equivalence.RUNS)
    with pytest.raises(pytest.skip.Exception, match="pp2: 2-process run not launched: 2 processes on this node but 1 GPU: one process per GPU"):
        runs["pp2"]
    assert runs["pp1"] == tmp_path / "pp1" and runs["reference-rope"] == tmp_path / "reference-rope" and launched == [1]
    monkeypatch.setattr(initialize, "gpu_count", lambda: 0)  # CPU: every count launches, each once
    monkeypatch.setattr(equivalence.Runs, "launch", lambda self, nproc: launched.append(nproc) or ("boom" if nproc == 4 else None))
    runs = equivalence.Runs(tmp_path, equivalence.RUNS)
    assert runs["pp2"] == tmp_path / "pp2" and runs["llama"] == tmp_path / "llama" and launched == [1, 2]  # both 2-process: one launch
    for name in ("pp4", "dp2xpp2"):  # a failed launch fails every test that needs it, launched once
        with pytest.raises(AssertionError, match="the 4-process launch failed:\nboom"):
            runs[name]
    assert launched == [1, 2, 4]


def step(iteration: int, ms: float, tflops: float, activation_gb: float) -> StepMetrics:
    elastic = ElasticMetrics(plan="plan[x] seqs=2", num_chunks={"batched": 1, "split": 0, "hybrid": 0}, num_pipelines=1, recomputed_layers=0,
                             planning_ms=1.0, planning_wait_ms=0.0, predicted_step_ms=1.0, measured_ms=ms - 5,
                             predicted_activation_bytes=[1.0], measured_activation_bytes=[int(activation_gb * 2**30)])
    return StepMetrics(iteration=iteration, loss=1.0, iter_ms=ms, tokens=1000.0, elastic=elastic, tflops_per_gpu=tflops)


def test_bench_gpu_json_pairs_steps_by_iteration_and_takes_medians():
    bench = importlib.import_module("benchmarks.bench_gpu")
    measured = {
        "megatron": [step(2, 300, 100, 10), step(3, 200, 200, 12), step(4, 900, 50, 11)],
        "seq1f1b": "pretrain_gpt.py failed (1): torch.OutOfMemoryError: CUDA out of memory",
        "epp": [step(4, 300, 150, 9), step(2, 100, 300, 8), step(3, 200, 200, 9.5)],  # out of order: paired by iteration
        "epp_unlimited": [step(2, 50, 600, 20), step(3, 150, 250, 22)],  # one step fewer: paired on the common two
    }
    entry = bench.cell_entry(bench.Cell("wiki", 16384), 35.5, measured, model_state_bytes=24 * 2**30)
    assert list(entry) == ["data", "cap", "budget_gb", "megatron", "seq1f1b", "epp", "epp_unlimited", "epp_vs_megatron", "epp_vs_ceiling",
                           "epp_vs_seq1f1b", "epp_vs_megatron_steps", "epp_vs_seq1f1b_steps"]
    assert entry["data"] == "wiki" and entry["cap"] == 16384 and entry["budget_gb"] == 35.5
    assert entry["megatron"] == {"tflops": 100, "step_ms": 300, "peak_gb": 36.0, "steps_ms": [300, 200, 900]}
    assert entry["epp"] == {"tflops": 200, "step_ms": 200, "peak_gb": 33.5, "steps_ms": [300, 100, 200]}
    assert entry["seq1f1b"] == {"tflops": None, "step_ms": None, "peak_gb": None, "error": measured["seq1f1b"]}
    assert entry["epp_unlimited"]["step_ms"] == 100 and entry["epp_unlimited"]["peak_gb"] == 46.0
    # per iteration megatron / epp: 300/100, 200/200, 900/300 -> median 3.0 (unpaired, the medians' ratio would be 1.5)
    assert entry["epp_vs_megatron"] == 3.0 and entry["epp_vs_megatron_steps"] == [3.0, 1.0, 3.0]  # in megatron's order
    assert entry["epp_vs_seq1f1b"] is None and entry["epp_vs_seq1f1b_steps"] == []
    assert entry["epp_vs_ceiling"] == 0.625  # 50/100, 150/200
    assert bench.paired_ratio(measured["seq1f1b"], measured["epp"]) is None
    json.dumps(entry)  # one JSON line


def test_bench_gpu_dry_run_lists_cells_budgets_and_commands(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_gpu.py"])  # its errors' name, as `python -m benchmarks.bench_gpu` runs it
    bench = importlib.import_module("benchmarks.bench_gpu")
    bench.main(["--dry-run", "--cells", "mock:16384"])  # in-process: one megatron import for the whole test
    out = capsys.readouterr().out
    assert "mock@16K: 16 documents per step" in out and "budget " in out and "Megatron packing's plans need without recompute" in out
    commands = [line for line in out.splitlines() if "pretrain_gpt.py" in line]
    assert [line.split()[0] for line in commands] == ["megatron", "seq1f1b", "epp", "epp_unlimited"]
    assert all(f" {flag} " in line for line in commands for flag in bench.LLAMA if flag.startswith("--"))
    budgets = [float(line.split("--epp-memory-budget ")[1].split()[0]) for line in commands]
    assert budgets[0] == budgets[1] == budgets[2] < budgets[3]  # the ceiling's budget is larger
    assert [line.split("--epp-plan ")[1].split()[0] for line in commands] == ["megatron", "seq1f1b", "elastic", "elastic"]
    assert not any(flag in out for flag in ("--epp-profile", "--epp-max-slices", "cudnn"))  # the defaults, as a user runs it
    assert "--global-batch-size 16 --train-iters 4" in commands[0]  # 1 warm-up + 3 measured steps
    assert "recomputed layers per step: megatron [" in out and "EPP needs no recompute" in out
    assert "estimated time on one H100:" in out.splitlines()[-1]
    refusals = [(["--dry-run", "--cells", "books:16384"], "--cells: 'books:16384': expected DATA:CAP")]
    if not torch.cuda.is_available():  # (on a GPU it would train)
        refusals.append((["--cells", "mock:16384"], "no CUDA device (torch.cuda.is_available() is False); --dry-run shows what would run"))
    for argv, error in refusals:
        with pytest.raises(SystemExit) as exit_:
            bench.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(f"bench_gpu.py: error: {error}") and len(err.strip().splitlines()) == 1


def test_gpu_check_bench_step_keeps_the_last_json_line_in_the_summary(tmp_path):
    """With a stand-in interpreter (``PYTHON``) that says CUDA is there and whose bench prints two cells' JSON lines then
    fails in a third: the summary keeps the last JSON line, and the step's failure."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/bash\n"
                    "if [ \"$1\" = -c ]; then echo ok; exit 0; fi\n"
                    "if [ \"$2\" = benchmarks.bench_gpu ]; then echo 'bench_gpu: 3 cell(s)'; echo '{\"device\": \"G\", \"cells\": [1]}';\n"
                    "  echo '{\"device\": \"G\", \"cells\": [1, 2]}'; echo '  [stdlib@32K] megatron FAILED'; exit 3; fi\n"
                    "exit 9\n")
    fake.chmod(0o755)
    out = tmp_path / "check"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--steps", "bench", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          env=run_env({"PYTHON": str(fake)}), timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = (out / "summary.txt").read_text().splitlines()[1]
    assert line.split()[:3] == ["bench", "FAILED", "rc=3"] and '{"device": "G", "cells": [1, 2]}' in line and "cells\": [1]}" not in line


def test_gpu_check_quick_fits_one_device_command_and_takes_the_default_path():
    dry = run("bash", "scripts/gpu_check.sh", "--quick", "--dry-run", "--out", "/tmp/x")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    steps = {line.split()[0]: line for line in lines[1:-1]}
    assert list(steps) == ["facts", "install", "attention", "equivalence", "fused", "train", "baseline"]
    limits = [int(line.split("(limit")[1].split("s)")[0]) for line in steps.values()]
    assert sum(limits) <= 570 and lines[-1] == f"limits: {sum(limits)} s in all"  # a device command is 600 s at most
    train, note = steps["train"].split(" (no --epp-profile")
    assert "--epp-profile" not in train and "--epp-memory-budget" not in train and "--log-throughput" in train
    assert "the start-up profile" in note and "the default budget" in note
    assert "--no-te --no-flash" in steps["install"] and "-k pp1" in steps["equivalence"]
    # the baseline: the same run on the same batches, the attention before flash-attn-4
    baseline = steps["baseline"].split("(limit")[1].split("s)  ", 1)[1]
    assert baseline.startswith("EPP_ATTENTION_BACKEND=varlen EPP_FUSED_KERNELS=torch ") and train.split("s)  ", 1)[1].split(" --epp-metrics")[0] in baseline
    assert baseline.split(" --epp-metrics ")[1].startswith("/tmp/x/metrics_baseline.jsonl")
    bad = run("bash", "scripts/gpu_check.sh", "--quick", "--build-timeout", "600", "--dry-run")
    assert bad.returncode == 2 and "--quick builds nothing" in bad.stderr


def test_gpu_check_quick_rehearsal_trains_on_the_default_path_and_reports_json(tmp_path):
    out = tmp_path / "quick"
    proc = run("bash", "scripts/gpu_check.sh", "--quick", "--cpu-rehearsal", "--steps", "fused,train,baseline,offload,bench", "--out", str(out),
               timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == json.loads((out / "report.json").read_text())
    assert set(report["steps"]) == {"fused", "train", "baseline", "offload", "bench"} and all(s["status"] == "ok" for s in report["steps"].values())
    # the opt-in offload step: K/V on the host checked (dry run here), the same batches with checkpoints offloaded, paired
    assert "check_kv_host_cuda: passed" in (out / "offload.log").read_text() and "> host link: measured " in (out / "offload.log").read_text()
    assert [p["iteration"] for p in report["offload_ab"]["pairs"]] == list(range(1, 7))
    assert [r["op"] for r in report["fused"]["results"]] == ["norm", "swiglu", "rope", "cross_entropy", "linear_cross_entropy"]
    # one iteration of each run traced by torch.profiler, summarised by kernel class (a CPU trace has no device kernels)
    assert all(report["traces"][run]["iteration"] == 5 and report["traces"][run]["steps"] == 1 for run in ("train", "baseline"))
    ab = report["kernels_ab"]  # the two runs paired by iteration (the same batches); no peak known for a CPU
    assert [p["iteration"] for p in ab["pairs"]] == list(range(1, 7)) and ab["median"]["speedup"] > 0 and ab["peak_tflops"] is None
    assert "EPP_ATTENTION_BACKEND=sdpa" in ab["attention"][1] and [s["loss"] for s in report["baseline"]["steps"]][:1] == [
        s["loss"] for s in report["train"]["steps"]][:1]
    train = report["train"]
    assert train["lines"]["planner"].startswith("planner: --epp-profile auto") and "memory budget" in train["lines"]["memory_budget"]
    assert train["iterations"] == 6 and train["median_tflops"] > 0 and train["oom_retries"] == 0
    for step in train["steps"]:
        memory = step["memory_gb"]
        assert memory["budget"] > 0 and len(memory["peak_reserved"]) == 1 and memory["peak_reserved"] == memory["peak_allocated"]
        assert memory["peak_reserved"][0] > memory["model_states"][0]
    assert "train: ok" in (out / "summary.txt").read_text()


def test_gpu_check_report_reads_a_step_over_the_budget_and_a_recovery(tmp_path):
    """The report's figures come from the records as written: a step whose reserved peak passed the budget is listed,
    the reserved and allocated peaks are kept apart, and the recovery lines of the log are carried."""
    report = importlib.import_module("benchmarks.gpu_check_report")
    gib = 2**30
    elastic = ElasticMetrics("plan[epp] x", {"batched": 2, "split": 0, "hybrid": 0}, 1, 4, 1.0, 0.0, 100.0, 110.0,
                             [10 * gib], [12 * gib], measured_allocated_bytes=[11 * gib], model_state_bytes=[5 * gib],
                             memory_budget_bytes=16 * gib, oom_retries=1, memory_factor=1.2)
    records = [StepMetrics(i, 5.0 - i, iter_ms=100.0, tokens=1000, elastic=elastic, tflops_per_gpu=10.0) for i in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    (tmp_path / "train.log").write_text("> planner: --epp-profile auto: measured\n iteration 2: out of memory on stage 0 (rank 0) ...\n")
    (tmp_path / "steps.tsv").write_text("train\tok\t12\t170\n")
    got = report.report(tmp_path)
    assert got["steps"] == {"train": {"status": "ok", "seconds": 12, "limit_s": 170}}
    step = got["train"]["steps"][0]["memory_gb"]
    assert step == {"budget": 16.0, "model_states": [5.0], "peak_reserved": [17.0], "peak_allocated": [16.0], "predicted_peak": [15.0]}
    assert got["train"]["steps_over_budget"] == [1, 2, 3] and got["train"]["oom_retries"] == 3
    assert got["train"]["lines"]["out_of_memory"] == [" iteration 2: out of memory on stage 0 (rank 0) ..."]
    assert got["train"]["largest_predicted_peak_share"] == 15 / 16
    assert got["bench"] is None and got["attention"] is None
    ok, line = report.train_verdict(tmp_path / "metrics.jsonl", default_path=True)
    assert ok and "binding: yes" in line and "out-of-memory retries 3" in line
