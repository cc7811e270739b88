"""The start-up profiler's memory, pinned on CPU (``megatron_epp.measure.profiling.measure_profile``).

* The CPU proof that the measurement works: the per-token bytes the profiler measures for a small LLaMA-like layer
  (GQA, SwiGLU, RMSNorm, RoPE, no biases) and a GPT-like one (LayerNorm, GELU, biases), in fp32 and bf16, equal
  ``saved_tensor_memory``'s count to the stored rounding (a thousandth of a byte): one layer's kept bytes, a
  checkpointed layer's and the output head's (as the last stage keeps them: final norm, output layer, megatron-core's
  cross entropy, the loss mask).
* A measured memory block (``derive`` ``"measured"``) is used as measured at its shape, and carried by its basis
  count's ratio to another vocabulary, width or TP; on a GPU's allocator the peak gives the backward's workspace.
* Out of memory at a grid point: the point is left out with one line; too few points left: the analytic profile,
  with a line. The output head's lengths are bounded by the device's free memory.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megatron_epp.base.dims import ParallelDims
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.profile_fit import measured_memory, per_token_fit
from megatron_epp.cost.activation_memory import MEASURED_COEFFS, gpu_activation_memory, saved_tensor_memory, shape_memory
from megatron_epp.cost.analytic import analytic_profile
from megatron_epp.cost.placement import place_profile, placement_note
from megatron_epp.cost.shape import ModelShape
from megatron_epp.measure import profile_resolution
from megatron_epp.measure import profiling
from megatron_epp.measure.layer_bench import init_single_process
from megatron_epp.model.gpt import attention_heads, model_shape
from megatron_epp.measure.profile_resolution import Target, describe, resolve_profile
from megatron_epp.measure.profiling import ProfileFailed, ProfileGrid, head_lengths_within, measure_profile
from megatron_epp.training.replay import parsed_config

LLAMA = ModelShape("llama-like", 1, 64, 8, 96, 128, num_kv_heads=2, kv_channels=16, normalization="RMSNorm", bias=False)
GPT = ModelShape("gpt-like", 1, 64, 4, 256, 128, swiglu=False)
GRID = ProfileGrid((16, 32), (0, 16, 32), (16, 32, 64), (16, 64), warmup=0, repeats=1)
TINY = ["--elastic-pp", "--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
        "--seq-length", "128", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1", "--epp-memory-budget", "1"]
FAKE_GPU = Target("cuda", torch.float32, gpu="Test GPU", kernel="sdpa-merged")  # measured on the CPU (measure_on)


def measure(shape: ModelShape, dtype: torch.dtype, grid: ProfileGrid = GRID, lines: list | None = None):
    init_single_process()
    log = lines.append if lines is not None else (lambda line: None)
    return measure_profile(shape, torch.device("cpu"), dtype, "sdpa-merged", grid, log=log)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [LLAMA, GPT], ids=["llama-like", "gpt-like"])
def test_the_profiler_measures_what_saved_tensor_memory_counts(shape, dtype):
    profile = measure(shape, dtype)
    memory, counted = profile.memory, saved_tensor_memory(profile.model)
    assert profile.model.dtype == str(dtype).removeprefix("torch.")
    for key in MEASURED_COEFFS:  # measured, each equal to the count
        assert getattr(memory, key) == counted[key], key
        assert profile.fit["memory"]["fits"][key]["rms_rel_err"] < 1e-9
    assert (memory.derive, memory.basis) == ("measured", "saved-tensors")
    assert (memory.bwd_workspace, memory.kv_grad) == (0.0, 0.0)  # no allocator on the CPU: as the saved tensors count them
    # the rest is the basis count's: the profile then predicts on the CPU what the derived one did
    assert dataclasses.asdict(memory) == {**dataclasses.asdict(memory), **counted}
    # the raw points: bytes per token the same at every length (nothing quadratic, no per-chunk constant)
    layer = profile.fit["memory"]["layer"]
    assert [k / s for s, k in zip(layer["lengths"], layer["kept"])] == [counted["act_token"]] * 3
    assert "peak" not in layer  # not measured on the CPU


def test_a_run_with_dropout_is_measured_without_and_its_masks_are_carried_by_the_count():
    """The stack measures without dropout, and the profile says so (its shape's dropout 0): placed on the run's shape,
    the masks a dropout saves are added by the basis count, not silently left out."""
    with_dropout = dataclasses.replace(GPT, hidden_dropout=0.1)
    profile = measure(with_dropout, torch.float32)
    assert (profile.model.hidden_dropout, profile.time_model.hidden_dropout) == (0.0, 0.0)
    carried = CostModel(dataclasses.replace(profile, model=dataclasses.replace(with_dropout, dtype="float32")), 1).profile.memory
    assert carried.act_token == pytest.approx(saved_tensor_memory(with_dropout)["act_token"], rel=1e-12)
    assert carried.act_token > profile.memory.act_token


def test_the_layers_input_is_a_tensor_of_its_own_inside_the_measurement():
    """On a GPU's allocator a tensor allocated before the measurement never counts, so the input is cloned inside it:
    it then counts where the layer keeps it (the GPT-like layer's LayerNorm does), as the output of the layer before
    it does in a model. (On the CPU the saved tensors count wherever they were allocated: same bytes either way.)"""
    init_single_process()
    stack = profiling.LayerStack(GPT, num_layers=1)
    stack.set_segments([32], [0])
    given = (torch.randn(32, 1, GPT.hidden, requires_grad=True),)
    seen = []

    def run(x):
        seen.append(x)
        return stack(x)

    kept, peak = profiling.MemoryMeter(stack.device, stack.context).measure(run, lambda: given)
    assert kept == 32 * saved_tensor_memory(GPT)["act_token"] and peak is None
    assert seen[0].untyped_storage().data_ptr() != given[0].untyped_storage().data_ptr()  # a tensor of its own
    assert given[0].grad is not None and given[0].grad.shape == given[0].shape  # and its gradient reaches the input


# ----------------------------------------------------------------------------- a measured block on other shapes
def measured_block(shape: ModelShape, factor: float = 1.3, device_type: str = "cuda") -> tuple:
    """A memory block as the profiler makes it from allocator readings ``factor`` x Megatron's count, with a backward
    workspace of 0.25 layers and the allocator's block rounding (a constant)."""
    counted = gpu_activation_memory(shape, 1)
    lengths = [1024, 4096, 16384]
    kept = [factor * counted["act_token"] * s + 512 for s in lengths]
    layer = {"lengths": lengths, "kept": kept, "peak": [1.25 * (k - 512) + 2048 for k in kept],
             "ckpt_kept": [factor * counted["ckpt_token"] * s + 512 for s in lengths], "ckpt_peak": None}
    head = {"lengths": [1024, 8192], "kept": [factor * counted["logits_token"] * s + 512 for s in (1024, 8192)]}
    return measured_memory(shape, device_type, layer, head)


def test_a_gpu_block_fits_per_token_bytes_and_the_workspace_from_the_allocator():
    shape = dataclasses.replace(LLAMA, hidden=4096, num_heads=32, num_kv_heads=8, kv_channels=None, ffn_hidden=11008, vocab=32000,
                                dtype="bfloat16")
    memory, record = measured_block(shape)
    counted = gpu_activation_memory(shape, 1)
    for key in MEASURED_COEFFS:
        assert getattr(memory, key) == pytest.approx(1.3 * counted[key], abs=1e-3), key
        assert record["fits"][key]["intercept_bytes"] == pytest.approx(512, abs=1e-3)
    assert memory.bwd_workspace == 0.25 and memory.kv_grad == 1.0  # the allocator's peak over the kept bytes; K/V grads held
    assert (memory.basis, memory.kv_token, memory.lone_slice_token) == ("megatron-gpu", counted["kv_token"], counted["lone_slice_token"])
    assert (memory.weight, memory.grad, memory.optim) == (2.0, 4.0, 12.0)
    # fp32 on a GPU: Megatron's count is bf16-only, the saved tensors are the basis
    assert measured_block(dataclasses.replace(shape, dtype="float32"))[0].basis == "saved-tensors"
    slope, fit = per_token_fit([10, 20, 40], [1000.0004, 2000.0004, 4000.0004])
    assert slope == 100.0 and fit["intercept_bytes"] == pytest.approx(0.0004)


def test_a_measured_block_is_kept_at_its_shape_and_carried_elsewhere_by_its_basis_ratio():
    """Never the measured bytes on another shape as they are, never dropped for the count: the measured excess over
    the basis count is kept (here 1.3x) for another vocabulary, width and TP; the unmeasured coefficients are the
    basis count's there; at the measured shape the block is as measured (a profile that goes through CostModel
    twice is unchanged)."""
    shape = dataclasses.replace(LLAMA, hidden=1024, num_heads=16, num_kv_heads=4, kv_channels=None, ffn_hidden=2816, vocab=32000,
                                dtype="bfloat16")
    memory, _ = measured_block(shape)
    profile = dataclasses.replace(analytic_profile(shape, 1), memory=memory, source="measured")
    assert shape_memory(profile) == profile
    assert CostModel(CostModel(profile, 1).profile, 1).profile.memory == profile.memory
    for other in (dataclasses.replace(shape, vocab=128256), dataclasses.replace(shape, hidden=2048, ffn_hidden=5632)):
        carried = CostModel(dataclasses.replace(profile, model=other), 1).profile.memory
        counted = gpu_activation_memory(other, 1)
        for key in MEASURED_COEFFS:
            assert getattr(carried, key) == pytest.approx(1.3 * counted[key], rel=1e-6), (other, key)
        assert (carried.kv_token, carried.lone_slice_token, carried.bwd_workspace, carried.kv_grad) == (
            counted["kv_token"], counted["lone_slice_token"], 0.25, 1.0)
    at_tp2, note = place_profile(profile, ParallelDims(tp=2)), placement_note(profile, ParallelDims(tp=2))
    assert note is not None and at_tp2.tp == 2
    counted = gpu_activation_memory(shape, 2)
    for key in MEASURED_COEFFS:
        assert getattr(at_tp2.memory, key) == pytest.approx(1.3 * counted[key], rel=1e-6), key
    assert CostModel(at_tp2, 1).profile.memory == at_tp2.memory  # at its (new) TP and shape: as carried


# ----------------------------------------------------------------------------- out of memory, the head's bound
def raise_at(monkeypatch, length: int | None, what: str = "forward") -> None:
    """A stand-in for a GPU that runs out of memory: the layer stack's ``what`` raises torch.OutOfMemoryError on
    ``length`` tokens (None: on every length)."""
    real = getattr(profiling.LayerStack, what)

    def stand_in(self, x, *args, **kwargs):
        if length is None or x.shape[0] == length:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 40.00 GiB (stand-in at {length})")
        return real(self, x, *args, **kwargs)

    monkeypatch.setattr(profiling.LayerStack, what, stand_in)


def test_out_of_memory_at_a_grid_point_leaves_the_point_out_with_one_line(monkeypatch):
    lines: list[str] = []
    raise_at(monkeypatch, 32)
    grid = dataclasses.replace(GRID, layer_lengths=(16, 32, 64, 128))
    profile = measure(LLAMA, torch.float32, grid, lines)
    assert profile.fit["out_of_memory"] == ["layer s=32"]
    assert [line for line in lines if "out of memory" in line] == [
        "  layer s=32: out of memory, left out (CUDA out of memory. Tried to allocate 40.00 GiB (stand-in at 32))"]
    assert [row[0] for row in profile.fit["timings"]["layer"]] == [16, 64, 128]
    assert profile.fit["memory"]["layer"]["lengths"] == [16, 64, 128]
    assert profile.memory.act_token == saved_tensor_memory(profile.model)["act_token"]  # the points left still fit it
    monkeypatch.undo()
    raise_at(monkeypatch, 64, "head_loss")
    assert measure(LLAMA, torch.float32, dataclasses.replace(GRID, head_lengths=(16, 32, 64))).fit["out_of_memory"] == ["head s=64"]


def test_too_few_points_left_raise_and_the_run_plans_on_the_analytic_profile_with_a_line(monkeypatch, tmp_path):
    raise_at(monkeypatch, None)
    with pytest.raises(ProfileFailed, match=r"the layer kept 0 grid points of the 3 its fit needs \(out of memory at layer s=16, "):
        measure(LLAMA, torch.float32)
    init_single_process()
    args = parsed_config([*TINY, "--epp-profile-cache", str(tmp_path)], world_size=1)
    lines: list[str] = []
    resolved = resolve_profile(args, FAKE_GPU, log=lines.append)
    assert resolved.profile == analytic_profile(model_shape(args), 1) and list(tmp_path.iterdir()) == []
    why = ("the start-up profiler could not measure a profile (the layer kept 0 grid points of the 3 its fit needs (out of memory at "
           "layer s=16, layer s=32, layer s=64, layer s=128)): the analytic profile of the model instead")
    assert lines[-1] == f"> planner: {why}" and sum("out of memory, left out" in line for line in lines) == 4
    assert describe(args, resolved).startswith(f"--epp-profile auto: analytic on H100-SXM bf16 x1 (TP) (model pretrain_gpt; {why}; key ")


def test_a_fault_of_the_start_up_profiler_plans_on_the_analytic_profile_with_its_error(monkeypatch, tmp_path):
    """Not only out-of-memory: any error the start-up measurement raises (a profiler fault) leaves the run on the
    analytic profile, the error's type and first line in the start-up line, nothing cached."""
    def broken(*args, **kwargs):
        raise ValueError("a fault of the profiler")

    monkeypatch.setattr(profile_resolution, "measure_profile", broken)
    init_single_process()
    args = parsed_config([*TINY, "--epp-profile-cache", str(tmp_path)], world_size=1)
    lines: list[str] = []
    resolved = resolve_profile(args, FAKE_GPU, log=lines.append)
    assert resolved.profile == analytic_profile(model_shape(args), 1) and list(tmp_path.iterdir()) == []
    assert lines[-1] == ("> planner: the start-up profiler could not measure a profile (ValueError: a fault of the profiler): "
                         "the analytic profile of the model instead")


def test_the_start_up_profile_is_made_when_a_point_runs_out_of_memory(monkeypatch, tmp_path):
    init_single_process()
    raise_at(monkeypatch, 64)
    args = parsed_config([*TINY, "--epp-profile-cache", str(tmp_path)], world_size=1)
    lines: list[str] = []
    resolved = resolve_profile(args, FAKE_GPU, log=lines.append)
    assert resolved.origin.startswith("cache miss, measured now") and resolved.profile.fit["out_of_memory"] == ["layer s=64"]
    assert [line for line in lines if "out of memory" in line] == [
        "  layer s=64: out of memory, left out (CUDA out of memory. Tried to allocate 40.00 GiB (stand-in at 64))"]


def test_the_heads_lengths_are_bounded_by_the_devices_free_memory(monkeypatch):
    """A 128K vocabulary at a 64K-token cap: the head point at 64K would hold 32 GiB of fp32 logits and as much
    gradient; with 70 GiB free the longest is cut to what half of it holds, and a line says so."""
    big = dataclasses.replace(LLAMA, vocab=131072, dtype="bfloat16")
    lines: list[str] = []
    kept = head_lengths_within((4096, 65536), big, 70 * 2**30, lines.append)
    cap = int(0.5 * 70 * 2**30 // (131072 * 12))
    assert kept == (4096, cap) and cap == 23893
    assert lines == [f"  head: lengths 4096, 65536 -> 4096, {cap} (the logits of {cap + 1} tokens, 1,572,864 B a token at vocabulary "
                     "131072, would take over 50% of the 70.0 GiB free)"]
    assert head_lengths_within((4096, 65536), big, 4 * 2**30, lambda line: None) == (85, 1365)  # both above it: two points below
    assert head_lengths_within((1024, 4096), big, 70 * 2**30, lines.append) == (1024, 4096) and len(lines) == 1  # within: as given
    # in the profiler: the free memory the device reports bounds the grid
    monkeypatch.setattr(profiling, "free_memory", lambda device: 2 * 76 * 2048 + 100.0)  # vocabulary 128 in fp32: 2048 B a token
    profile = measure(dataclasses.replace(LLAMA, vocab=128), torch.float32, dataclasses.replace(GRID, head_lengths=(16, 64, 256)))
    assert [row[0] for row in profile.fit["timings"]["head"]] == [16, 64, 76]


def test_the_run_measures_in_its_dtype_with_its_attention_kernel(monkeypatch):
    """``Target.of_run`` on a CUDA device (a stand-in): ``--fp16`` is measured in fp16 (not fp32), ``--bf16`` in bf16,
    and the kernel is chosen for ``--attention-backend`` as the executor chooses it (not the environment's default)."""
    asked = []

    def select(request, device, dtype, decided=None, dropout=0.0, gqa=False, heads=None, deterministic=False):
        asked.append((request, dtype, gqa))
        probed.append(heads)  # the head shape flash-attn-4's probe (and compiles) run: one rank's
        return f"kernel-for-{request}"

    probed = []

    monkeypatch.setattr(profile_resolution.kernels, "select_backend", select)
    monkeypatch.setattr(profile_resolution.torch.cuda, "get_device_name", lambda device: "Test GPU")
    monkeypatch.setattr(profile_resolution.torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # the fused kernels' probe
    monkeypatch.delenv("EPP_ATTENTION_BACKEND", raising=False)
    cuda = torch.device("cuda")
    fp16 = Target.of_run(parsed_config([*TINY, "--fp16"], world_size=1), cuda)
    assert (fp16.dtype, fp16.kernel, fp16.gpu) == (torch.float16, "kernel-for-auto", "Test GPU")
    assert Target.of_run(parsed_config([*TINY, "--bf16"], world_size=1), cuda).dtype == torch.bfloat16
    local = Target.of_run(parsed_config([*TINY, "--attention-backend", "local"], world_size=1), cuda)
    assert local.kernel == "kernel-for-sdpa" and asked[-1] == ("sdpa", torch.float32, True)
    tiny = parsed_config(TINY, world_size=1)
    assert probed[-1] == attention_heads(tiny) == (tiny.model.num_attention_heads, tiny.model.kv_heads,
                                                   tiny.model.hidden_size // tiny.model.num_attention_heads)
    # the key has the dtype and the kernel: another dtype or kernel is another profile
    shape = model_shape(parsed_config(TINY, world_size=1))
    assert fp16.key(shape, 128) != dataclasses.replace(fp16, dtype=torch.float32).key(shape, 128) != local.key(shape, 128)
    assert fp16.key(shape, 128).dtype == "float16"


def test_the_budget_is_checked_again_on_the_profile_resolved_at_start_up(monkeypatch):
    """A measured profile's memory may exceed the count the check before start-up used: the elastic step mode checks
    the budget on the resolved profile too, in one line, before any step."""
    from megatron_epp.training import step
    from megatron_epp.config.errors import ArgumentError

    cfg = parsed_config([*TINY, "--epp-memory-budget", "0.05"], world_size=1)
    mode = step.ElasticSteps(cfg)  # the CPU profile's count fits
    mode.loaded = None  # as where auto on CUDA measures the profile after start-up
    before = mode.budget
    fitted = profile_resolution.resolve_profile(cfg, Target("cpu", torch.float32))
    heavy = dataclasses.replace(fitted.profile, memory=dataclasses.replace(fitted.profile.memory, derive="",
                                                                            act_token=fitted.profile.memory.act_token * 1e6))
    monkeypatch.setattr(step, "startup_profile", lambda cfg, device: profile_resolution.Resolved(heavy, "measured at start-up"))
    with pytest.raises(ArgumentError, match=r"--epp-memory-budget 0\.0\d* GB: 2 documents of --seq-length 128 tokens per replica "
                                             "cannot be planned"):
        mode.start(type("Runtime", (), {"device": torch.device("cpu")})())
    monkeypatch.setattr(step, "startup_profile", lambda cfg, device: fitted)
    mode.start(type("Runtime", (), {"device": torch.device("cpu")})())
    assert mode.budget == before and mode.profile is fitted


def test_the_memory_fit_is_least_squares_over_the_lengths():
    n = np.array([100, 200, 400, 800])
    noisy = 300.0 * n + 4096 + np.array([10.0, -10.0, 10.0, -10.0])
    slope, fit = per_token_fit(n, noisy)
    expected = np.polyfit(n, noisy, 1)
    assert slope == round(expected[0], 3) and fit["intercept_bytes"] == pytest.approx(expected[1]) and fit["points"] == 4
    assert 0 < fit["rms_rel_err"] < 1e-3
