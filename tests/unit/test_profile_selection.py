"""Which cost profile a run plans on (``--epp-profile``, ``megatron_epp.measure.profile_resolution``), pinned on CPU.

* ``auto`` on the CPU: the shipped CPU profile nearest the model (as ``cpu``);
* ``auto`` on CUDA: the cached profile of this GPU, dtype, kernel, torch version, context cap and layer shape (a hit);
  the shipped H100 profile, of the older key format, is ignored cleanly; without one, the start-up profiler measures
  (here: the real profiler, a tiny model and grid on the CPU standing in for a GPU), writes the cache atomically, and
  the next run hits it; at TP > 1 without one, the analytic profile with the reason (never a refusal);
* a CPU-measured profile on CUDA is refused in one line;
* the cache key: another GPU, dtype, kernel, torch version, context cap or layer shape misses;
* the recompute fit on the H100 timings of ``gpu-evidence/2026-11-25-h100``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_epp.cost.profile_fit import fit, recompute_fit
from megatron_epp.cost.analytic import analytic_profile
from megatron_epp.cost.profile import Profile, TimeCoeffs
from megatron_epp.cost.profile_lookup import PROFILE_DIR, ProfileKey, find_measured_profile, is_cpu_profile, load_profile
from megatron_epp.training.replay import parsed_config
from megatron_epp.measure.layer_bench import init_single_process
from megatron_epp.config.errors import ArgumentError
from megatron_epp.model.gpt import model_shape
from megatron_epp.training.planning import online_planner
from megatron_epp.measure.profile_resolution import Target, describe, planner_profile, resolve_profile, startup_profile
from tests.paths import SHARED

EVIDENCE = SHARED / "gpu-evidence" / "2026-11-25-h100"
TINY = ["--elastic-pp", "--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
        "--seq-length", "128", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1", "--epp-memory-budget", "1"]
FAKE_GPU = Target("cuda", torch.float32, gpu="Test GPU", kernel="sdpa-merged")  # measured on the CPU (measure_on)


def args_for(*extra: str, cache: Path | None = None):
    return parsed_config([*TINY, *extra, *(["--epp-profile-cache", str(cache)] if cache else [])], world_size=1)


def test_auto_on_cpu_plans_on_the_nearest_shipped_cpu_profile():
    args = args_for()
    assert args.epp.planner.profile == "auto"
    resolved = resolve_profile(args, Target("cpu", torch.float32))
    assert is_cpu_profile(resolved.profile) and resolved.profile == load_profile("cpu", tp=1, shape=model_shape(args))
    assert describe(args, resolved).startswith("--epp-profile auto: measured on CPU ")
    assert "the shipped CPU profile nearest the model" in describe(args, resolved)


def test_a_cpu_profile_on_cuda_is_refused_in_one_line(tmp_path):
    for spec in ("cpu", "test-model", str(PROFILE_DIR / "test-model_cpu.json")):
        with pytest.raises(ArgumentError) as error:
            resolve_profile(args_for("--epp-profile", spec), FAKE_GPU)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"pretrain_gpt.py: error: --epp-profile {spec}: measured on CPU ")
        assert "this run is on CUDA; use --epp-profile auto" in message
    # analytic (the model's own shape) is a GPU profile: allowed
    analytic = resolve_profile(args_for("--epp-profile", "analytic"), FAKE_GPU).profile
    assert analytic.source == "analytic" and analytic.model.hidden == 32 and analytic.tp == 1


def gpu_profile_for(args, gpu: str = "Test GPU", dtype: str = "float32", kernel: str = "sdpa-merged") -> Profile:
    """The shipped H100 profile relabelled as measured on ``gpu`` at the run's shape, with this torch and the run's
    context cap recorded (a cached profile of the current key format)."""
    shipped = Profile.load(PROFILE_DIR / "gpu-h1024_h100_tp1.json")
    shape = model_shape(args, "cached")
    fit = {**shipped.fit, "torch": torch.__version__, "seq_length": args.model.seq_length}
    return dataclasses.replace(shipped, device=f"{gpu} ({dtype}, {kernel})", model=shape, time_model=shape, fit=fit)


def key_of(args, target: Target = FAKE_GPU) -> ProfileKey:
    return target.key(model_shape(args), args.model.seq_length)


def test_auto_on_cuda_takes_the_cached_profile_of_its_key(tmp_path):
    args = args_for(cache=tmp_path)
    cached = gpu_profile_for(args)
    key = key_of(args)
    assert ProfileKey.from_profile(cached) == key
    cached.save(tmp_path / key.file_name())
    resolved = resolve_profile(args, FAKE_GPU)
    assert resolved.profile == cached and resolved.origin == f"cache hit {tmp_path / key.file_name()}"
    assert describe(args, resolved).startswith("--epp-profile auto: measured on Test GPU (float32, sdpa-merged) (model cached; cache hit ")
    # the start-up line prints the key it was looked up by
    assert describe(args, resolved).endswith(f"; key Test GPU, float32, sdpa-merged, torch {torch.__version__}, cap 128, hidden 32, "
                                             "4 heads (2 K/V) x 8, ffn 64 SwiGLU, RMSNorm, no biases)")
    # a profile placed in the cache under another name (python -m megatron_epp.measure.profile_gpu --out) is found by its key too
    (tmp_path / key.file_name()).rename(tmp_path / "by-hand.json")
    assert find_measured_profile(key, tmp_path)[0] == tmp_path / "by-hand.json"


def test_the_cache_key_holds_gpu_dtype_kernel_and_layer_shape(tmp_path):
    args = args_for()
    shape = model_shape(args)
    key = key_of(args)
    gpu_profile_for(args).save(tmp_path / key.file_name())
    assert find_measured_profile(key, tmp_path) is not None
    version = torch.__version__
    others = [
        ProfileKey.of("Other GPU", "float32", "sdpa-merged", shape, version, 128),
        ProfileKey.of("Test GPU", "bfloat16", "sdpa-merged", shape, version, 128),
        ProfileKey.of("Test GPU", "float16", "sdpa-merged", shape, version, 128),
        ProfileKey.of("Test GPU", "float32", "torch-varlen", shape, version, 128),
        ProfileKey.of("Test GPU", "float32", "sdpa-merged", shape, "2.11.0+cu130", 128),
        ProfileKey.of("Test GPU", "float32", "sdpa-merged", shape, version, 256),
        ProfileKey.of("Test GPU", "float32", "sdpa-merged", dataclasses.replace(shape, hidden=64), version, 128),
        ProfileKey.of("Test GPU", "float32", "sdpa-merged", dataclasses.replace(shape, num_kv_heads=4), version, 128),
        ProfileKey.of("Test GPU", "float32", "sdpa-merged", dataclasses.replace(shape, swiglu=False), version, 128),
    ]
    for other in others:
        assert other != key and other.file_name() != key.file_name()
        assert find_measured_profile(other, tmp_path) is None, other
    # layers, vocabulary, dropout and the name are not the layer's time: the same key
    same = dataclasses.replace(shape, name="x", num_layers=7, vocab=999, hidden_dropout=0.1)
    assert ProfileKey.of("Test GPU", "fp32", "sdpa-merged", same, version, 128) == key
    # another run's cap or torch is another key: the run looks its own up
    assert key_of(args.replace(model={"seq_length": 256})) == others[5]
    assert key_of(args, dataclasses.replace(FAKE_GPU, torch_version="2.11.0+cu130")) == others[4]


H1024 = ["--elastic-pp", "--mock-data", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
         "--seq-length", "16384", "--global-batch-size", "32", "--lr", "1e-3", "--train-iters", "1", "--bf16", "--epp-memory-budget", "60"]
H100 = Target("cuda", torch.bfloat16, gpu="NVIDIA H100 80GB HBM3", kernel="sdpa-causal", torch_version="2.11.0+cu130")


def test_a_profile_of_the_older_key_format_is_ignored_cleanly_and_still_loads_as_a_file(tmp_path):
    """The shipped H100 h1024 profile (2026-11-25) records no context cap: it is no key's profile, so ``auto`` does
    not take it even on its own GPU, kernel and torch (it would plan on its unmeasured memory); it is listed as
    ignored, and ``--epp-profile FILE`` still loads it."""
    shipped = PROFILE_DIR / "gpu-h1024_h100_tp1.json"
    args = parsed_config([*H1024, "--epp-profile-cache", str(tmp_path)], world_size=1)
    key = key_of(args, H100)
    older: list = []
    assert ProfileKey.from_profile(Profile.load(shipped)) is None
    assert find_measured_profile(key, tmp_path, older) is None and older == [shipped]
    (tmp_path / "copy.json").write_text(shipped.read_text())  # in the cache too: ignored there as well, no error
    assert find_measured_profile(key, tmp_path, older) is None and tmp_path / "copy.json" in older
    loaded = resolve_profile(parsed_config([*H1024, "--epp-profile", str(shipped)], world_size=1), H100)
    assert loaded.origin == f"file {shipped}" and loaded.profile.source == "measured"


def test_auto_at_tp_2_without_a_profile_plans_on_the_analytic_one_and_says_why(tmp_path):
    """Never a refusal: at TP > 1 the start-up profiler (a whole layer on one GPU) cannot measure the run's shard, so
    the run plans on its model's analytic profile at its TP, and the start-up line says so, why, and the key."""
    args = parsed_config([*H1024, "--epp-profile-cache", str(tmp_path), "--tensor-model-parallel-size", "2"], world_size=2)
    lines: list[str] = []
    resolved = resolve_profile(args, H100, log=lines.append)
    assert resolved.profile == analytic_profile(model_shape(args), 2) and lines == [] and list(tmp_path.iterdir()) == []
    line = describe(args, resolved)
    assert line.startswith("--epp-profile auto: analytic on H100-SXM bf16 x2 (TP) (model pretrain_gpt; no measured profile of this "
                           f"key in {tmp_path} (1 of an older key format ignored: gpu-h1024_h100_tp1.json), and the start-up "
                           "profiler measures a whole layer on one GPU, not a TP 2 shard: the analytic profile of the model instead")
    assert line.endswith(f"; key {key_of(args, H100).describe()})") and "\n" not in line
    # the same from the driver's start-up step (every rank plans on it)
    started = startup_profile(args, torch.device("cpu"), target=H100)
    assert started.profile == resolved.profile and describe(args, started) == line


def test_auto_on_cuda_without_a_profile_measures_one_caches_it_and_the_next_run_hits(tmp_path):
    init_single_process()
    cache = tmp_path / "cache"
    args = args_for(cache=cache)
    lines: list[str] = []
    rng = torch.random.get_rng_state()
    resolved = resolve_profile(args, FAKE_GPU, log=lines.append)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the run's seeds as they were
    key = key_of(args)
    path = cache / key.file_name()
    assert re.fullmatch(rf"cache miss, measured now in [0-9.]+ s, cached at {re.escape(str(path))}", resolved.origin)
    assert lines[0].startswith(f"> planner: no measured profile of Test GPU, float32, sdpa-merged, torch {torch.__version__}, cap 128, "
                               "hidden 32, 4 heads (2 K/V)")
    assert sum(bool(re.match(r"\s+(attention|layer|head) s=", line)) for line in lines) == 6 + 4 + 2  # one line a point
    assert sum("rms rel err" in line for line in lines) == 7
    assert sum(line.startswith("  memory (measured, saved-tensors basis): act_token ") for line in lines) == 1
    profile = resolved.profile
    assert profile.source == "measured" and profile.device == "Test GPU (float32, sdpa-merged)"
    assert ProfileKey.from_profile(profile) == key and profile.model.num_kv_heads == 2 and profile.model.swiglu
    assert set(profile.fit["errors"]) == {"attention_fwd", "attention_bwd", "fwd", "bwd", "recompute", "head_fwd", "head_bwd"}
    assert profile.fit["seconds"] < 60 and profile.fit["skipped"] == [] and profile.fit["out_of_memory"] == []
    assert profile.memory.derive == "measured" and profile.fit["seq_length"] == 128  # its memory measured (test_profile_memory.py)
    # written atomically (no temporary left) and read back whole
    assert sorted(p.name for p in cache.iterdir()) == [path.name]
    assert Profile.load(path).to_dict() == profile.to_dict()
    again = resolve_profile(args, FAKE_GPU, log=lines.append)
    assert again.origin == f"cache hit {path}" and again.profile == Profile.load(path)
    # the driver's start-up step: every rank plans on the profile it resolved
    started = startup_profile(args, torch.device("cpu"), target=FAKE_GPU)
    assert describe(args, started).startswith("--epp-profile auto: measured on Test GPU") and started.profile == again.profile
    assert online_planner(args, started.profile).cost_model.profile == again.profile
    # before start-up (the memory-budget check) auto plans on the CPU here: this process has no GPU
    assert is_cpu_profile(planner_profile(args))


def test_profile_writes_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    first = load_profile("test-model")
    first.save(path)
    second = dataclasses.replace(first, device="CPU other (1 thread, fp32, sdpa-merged)")

    def torn(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", torn)
    with pytest.raises(OSError, match="disk full"):
        second.save(path)
    assert Profile.load(path) == first and sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]
    monkeypatch.undo()
    second.save(path)
    assert Profile.load(path) == second and sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def logged_layer_timings() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The layer lines of the H100 h1024 profiler log: lengths, forward, backward and recompute ms."""
    log = EVIDENCE / "logs" / "profile_gpu_h1024.log"
    if not log.exists():
        pytest.skip(f"{log} not here (shared/ beside the clone)")
    rows = re.findall(r"layer s=\s*(\d+): fwd\s+([\d.]+) ms\s+bwd\s+([\d.]+) ms\s+recompute\s+([\d.]+) ms", log.read_text())
    return tuple(np.array(column, dtype=float) for column in zip(*rows))  # type: ignore[return-value]


def test_recompute_fit_on_the_logged_h100_timings():
    """The old recompute model (a ratio of the fitted forward plus a constant) fitted the H100 h1024 recompute timings
    with 27 % rms error (the profile's own record); the new one (the forward's attention part scaled, its own per-token
    and per-chunk terms) fits them better. Neither can reach 10 % on these 6 points: they are the difference of two
    separately taken medians in the launch-bound regime and not monotone in s (8192 tokens below 2048 and 4096), which
    no cost model reproduces; the profiler now times the two back to back per repeat (``Timer.paired``)."""
    n, f, b, rc = logged_layer_timings()
    shipped = Profile.load(PROFILE_DIR / "gpu-h1024_h100_tp1.json")
    fwd = shipped.fwd
    fwd_pred = fwd.a1 * n**2 + fwd.a2 * n + fwd.bs + fwd.b1
    _, old = fit(np.stack([fwd_pred, np.ones_like(n)], 1), rc)
    assert old["rms_rel_err"] == pytest.approx(shipped.fit["errors"]["recompute"]["rms_rel_err"], rel=1e-3)
    coeffs, new = recompute_fit(n, rc, fwd)
    assert new["rms_rel_err"] < old["rms_rel_err"] - 0.05 and new["max_rel_err"] < old["max_rel_err"]
    assert rc[n == 8192][0] < rc[n == 2048][0]  # why nothing fits within 10 %: the timings are not monotone
    # the fitted coefficients predict exactly what the fit reports
    pred = coeffs.a1 * n**2 + coeffs.a2 * n + coeffs.bs + coeffs.b1
    assert np.sqrt(np.mean((pred / rc - 1) ** 2)) == pytest.approx(new["rms_rel_err"])


def test_recompute_fit_recovers_a_recompute_that_is_not_a_ratio_of_the_forward():
    """A recompute with its own per-chunk constant (less than the forward's: launches hidden under the backward) and
    the forward's per-token work: the new model recovers it exactly where the ratio model is off by over 10 %."""
    fwd = TimeCoeffs(4e-9, 1.4e-8, 3.7e-5, 0.0, 0.28, 1.84)
    n = np.array([1024, 2048, 4096, 8192, 16384, 32768], dtype=float)
    truth = 0.9 * (fwd.a1 * n**2 + fwd.bs) + fwd.a2 * n + 0.6
    coeffs, err = recompute_fit(n, truth, fwd)
    assert err["rms_rel_err"] < 1e-6 and coeffs.b1 == pytest.approx(0.6, rel=1e-4)
    fwd_pred = fwd.a1 * n**2 + fwd.a2 * n + fwd.bs + fwd.b1
    assert fit(np.stack([fwd_pred, np.ones_like(n)], 1), truth)[1]["rms_rel_err"] > 0.10
