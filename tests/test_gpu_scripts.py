"""The GPU scripts on CPU: what can be checked before device time is spent.

* ``check_cuda_attention.py`` without flash-attn checks torch's varlen and the SDPA paths and reports flash as skipped
  (it used to exit 2); without CUDA, outside its dry run, it refuses with one line;
* ``profile_gpu.py --device cpu`` on a tiny grid writes a profile the planner loads, marked measured
  on this CPU, with its fit errors, and ``epp-plan`` plans on it;
* ``gpu_check.sh`` refuses without CUDA (one line), lists its steps with ``--dry-run``, and its
  ``--cpu-rehearsal`` runs the attention check, the profiler and the bf16 pp=1 training end to end.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

from megatron_epp.cost.profiles import load_profile
from tests.launch import REPO, run_env


def run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=timeout)


def test_attention_check_without_flash_runs_sdpa_and_reports_flash_skipped():
    proc = run(sys.executable, "scripts/check_cuda_attention.py", "--cpu-dry-run", "--without-flash")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("flash-varlen  skipped (--without-flash)") == 3  # batched, split x4, hybrid
    assert out.count("  sdpa-causal ") == 3 and out.count("  sdpa-masked ") == 3 and out.count("  torch-varlen ") == 3
    assert "PASS: torch-varlen and SDPA paths match fp32; flash-varlen skipped (--without-flash)" in out
    refused = run(sys.executable, "scripts/check_cuda_attention.py")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "check_cuda_attention: no CUDA device (use --cpu-dry-run to check the script on CPU)"]


def test_gpu_profiler_smoke_run_on_cpu_makes_a_profile_the_planner_reads(tmp_path):
    out = tmp_path / "profile.json"
    llama = ("--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
             "--disable-bias-linear", "--kv-channels", "16", "--rotary-base", "500000")  # pretrain_gpt.py's flags
    proc = run(sys.executable, "scripts/profile_gpu.py", "--device", "cpu", "--hidden-size", "32", "--num-attention-heads", "4",
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
    lengths = tmp_path / "lengths.txt.gz"
    with gzip.open(lengths, "wt") as f:
        f.write("\n".join(map(str, [300, 100, 40, 20] * 4)) + "\n")
    plan = run(sys.executable, "-m", "megatron_epp.planner", str(lengths), "--epp-profile", str(out), "--stages", "2", "--tp", "1",
               "--max-seq-len", "512", "--epp-memory-budget", "1", "--baselines", "", "--json")
    assert plan.returncode == 0, plan.stderr
    summary = json.loads(plan.stdout.strip().splitlines()[-1])
    assert summary["profile_source"] == "measured" and summary["device"] == profile.device
    bad = run(sys.executable, "scripts/profile_gpu.py", "--out", str(tmp_path / "x.json"))  # --device cuda here
    assert bad.returncode == 2 and "--device cuda: torch.cuda.is_available() is False" in bad.stderr
    for flags, message in ((["--num-query-groups", "3", "--group-query-attention"], "not divisible by --num-query-groups 3"),
                           (["--elastic-pp"], "--elastic-pp: not a flag of this script nor a model flag of pretrain_gpt.py")):
        bad = run(sys.executable, "scripts/profile_gpu.py", "--device", "cpu", *flags, "--out", str(tmp_path / "x.json"))
        last = bad.stderr.strip().splitlines()[-1]  # argparse's usage, then one error line
        assert bad.returncode == 2 and last.startswith("profile_gpu.py: error: ") and message in last and bad.stderr.count("error") == 1, bad.stderr


def test_gpu_check_refuses_without_cuda_and_lists_its_steps():
    refused = run("bash", "scripts/gpu_check.sh")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()] and "gpu_check.sh: error: no CUDA device" in refused.stderr
    dry = run("bash", "scripts/gpu_check.sh", "--dry-run", "--out", "/tmp/x")
    assert dry.returncode == 0
    steps = [line.split()[0] for line in dry.stdout.splitlines()[1:]]
    assert steps == ["facts", "install", "attention", "equivalence", "profile", "train"]
    assert "setup_gpu.sh --find-links" in dry.stdout and "tests/test_elastic_equivalence.py -k pp1" in dry.stdout
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
