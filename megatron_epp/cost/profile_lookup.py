"""Which profile ``--epp-profile`` names: the presets, the shipped profiles (:data:`PROFILE_DIR`), the cache of
GPU profiles measured per :class:`ProfileKey`, the shipped CPU profile nearest a shape (a profile is placed on a
layout by :func:`~megatron_epp.cost.placement.place_profile`)."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_epp.cost.analytic import analytic_profile
from megatron_epp.cost.profile import Profile
from megatron_epp.cost.shape import MODEL_PRESETS, TEST_MODEL, ModelShape

PROFILE_DIR = Path(__file__).parent / "profiles"

# ``--epp-profile cpu``: the shipped CPU profiles (``PROFILE_DIR/*_cpu.json``, each measured by
# ``benchmarks/profile_layer.py`` and calibrated by ``benchmarks/calibrate_step.py`` on this project's 2-core machines),
# the one measured nearest the model that runs (:func:`nearest_cpu_profile`)
CPU_PROFILES = "cpu"
# ``--epp-profile auto`` (the default): on CUDA a profile measured on this GPU for this dtype, attention kernel and
# layer shape (the cache, a shipped one, or measured at start-up: ``megatron_epp.measure.profile_resolution``); on the
# CPU, ``cpu``. ``--epp-profile analytic``: the analytic (FLOPs / peak x MFU) profile of the model's own shape
AUTO_PROFILE = "auto"
ANALYTIC_PROFILE = "analytic"
TEST_MODEL_PROFILE = PROFILE_DIR / f"{TEST_MODEL.name}_cpu.json"  # ``--epp-profile test-model``: hidden 64
PROFILE_NAMES = (AUTO_PROFILE, ANALYTIC_PROFILE, CPU_PROFILES, TEST_MODEL.name, *MODEL_PRESETS)
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "float32": "float32"}


def is_cpu_profile(profile: Profile) -> bool:
    """Measured on a CPU (``benchmarks/profile_layer.py``, or ``python -m megatron_epp.measure.profile_gpu --device cpu``): its
    device names the CPU. Such a profile predicts a GPU's step hundreds of times too slow."""
    return profile.source == "measured" and profile.device.startswith("CPU ")


@dataclass(frozen=True)
class ProfileKey:
    """What a measured GPU profile is valid for: the GPU's name, the activations' dtype, the attention kernel
    the executor runs there, the torch version (its kernels), the context cap (``--seq-length``: the start-up
    profiler's grid is drawn from it) and the layer's shape as far as its time and memory depend on it (widths,
    heads, K/V heads, head dimension, MLP, norm, biases, positions). Layers, vocabulary and dropout are not in it:
    the profile is per layer, and the output head is carried to another vocabulary (its time by FLOPs,
    :func:`shape_time`; its measured bytes by the basis count,
    :func:`~megatron_epp.cost.activation_memory.carry_measured_memory`).

    A profile records its key's torch version and context cap in ``fit["torch"]`` and ``fit["seq_length"]``;
    one written before 2026-11-27 has no cap (an older key format): it is no key's profile, and
    ``--epp-profile auto`` measures afresh (:func:`find_measured_profile` lists it as ignored)."""

    gpu: str
    dtype: str
    kernel: str
    torch: str
    seq_length: int
    layer: tuple

    @classmethod
    def of(cls, gpu: str, dtype: str, kernel: str, shape: ModelShape, torch: str, seq_length: int) -> "ProfileKey":
        layer = (shape.hidden, shape.num_heads, shape.ffn_hidden, shape.num_kv_heads or shape.num_heads, shape.head_dim,
                 shape.swiglu, shape.rope, shape.normalization, shape.bias)
        return cls(gpu, DTYPE_NAMES.get(dtype, dtype), kernel, torch, int(seq_length), layer)

    @classmethod
    def from_profile(cls, profile: Profile) -> "ProfileKey | None":
        """The key of a measured GPU profile, read off its ``device`` (``"GPU name (dtype, kernel)"``, as
        ``python -m megatron_epp.measure.profile_gpu`` and the start-up profiler write it), its ``fit``'s torch version and context cap,
        and the shape its times were measured at; None for a CPU or an analytic profile, or one of the older key
        format (:func:`is_older_key_format`)."""
        match = re.fullmatch(r"(.+) \(([^,()]+), ([^,()]+)\)", profile.device)
        if profile.source != "measured" or is_cpu_profile(profile) or match is None or is_older_key_format(profile):
            return None
        return cls.of(match[1], match[2], match[3], profile.time_model, str(profile.fit["torch"]), int(profile.fit["seq_length"]))

    def file_name(self) -> str:
        """The cache file of this key: readable parts, and a digest of the whole key."""
        digest = hashlib.sha1(repr(self).encode()).hexdigest()[:10]
        gpu = re.sub(r"[^a-z0-9]+", "-", self.gpu.lower()).strip("-")
        return f"{gpu}_{self.dtype}_{self.kernel}_h{self.layer[0]}_s{self.seq_length}_{digest}.json"

    def describe(self) -> str:
        h, heads, ffn, kv_heads, d, swiglu, rope, norm, bias = self.layer
        return (f"{self.gpu}, {self.dtype}, {self.kernel}, torch {self.torch}, cap {self.seq_length}, hidden {h}, {heads} heads "
                f"({kv_heads} K/V) x {d}, ffn {ffn}{' SwiGLU' if swiglu else ''}, {norm}{'' if bias else ', no biases'}"
                f"{'' if rope else ', learned positions'}")


def is_older_key_format(profile: Profile) -> bool:
    """A measured GPU profile written before its key held the torch version and the context cap (2026-11-27): no
    ``fit["torch"]`` or ``fit["seq_length"]``."""
    return not is_cpu_profile(profile) and profile.source == "measured" and not {"torch", "seq_length"} <= set(profile.fit)


def default_profile_cache() -> Path:
    """``--epp-profile-cache``'s default: ``$XDG_CACHE_HOME/megatron-epp/profiles`` (``~/.cache`` without it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-epp" / "profiles"


def kernel_cache_dir(profile_cache: str | Path | None, kernel: str = "flash-attn-4") -> Path:
    """Where a kernel library's compiled variants are cached for the run: ``kernels/KERNEL`` in the profile cache
    (``--epp-profile-cache``, else :func:`default_profile_cache`)."""
    return Path(profile_cache or default_profile_cache()).expanduser() / "kernels" / kernel


def find_measured_profile(key: ProfileKey, cache_dir: str | Path | None,
                          older: list[Path] | None = None) -> tuple[Path, Profile] | None:
    """The measured GPU profile of ``key``: the cache's own file for it, any other profile in the cache with
    that key (``python -m megatron_epp.measure.profile_gpu --out`` placed there), else a shipped one (``PROFILE_DIR``); None if none.
    Profiles of the older key format (:func:`is_older_key_format`) are no match; their paths go to ``older``."""
    cache = Path(cache_dir) if cache_dir is not None else None
    candidates = [cache / key.file_name()] if cache is not None else []
    candidates += sorted(cache.glob("*.json")) if cache is not None and cache.is_dir() else []
    candidates += [p for p in sorted(PROFILE_DIR.glob("*.json")) if not p.name.endswith("_cpu.json")]
    for path in dict.fromkeys(candidates):
        if not path.is_file():
            continue
        try:
            profile = Profile.load(path)
        except (ValueError, OSError, KeyError, TypeError):
            continue  # not a profile (or a torn file from before writes were atomic): not a match
        if ProfileKey.from_profile(profile) == key:
            return path, profile
        if older is not None and is_older_key_format(profile):
            older.append(path)
    return None


def check_profile_device(profile: Profile, spec: str, device: str) -> None:
    """A ``ValueError`` (one line, with the way out) for a CPU-measured profile on a GPU run: its times are a
    CPU's, hundreds of times a GPU's, and the planner would split what it should pack."""
    if device == "cuda" and is_cpu_profile(profile):
        raise ValueError(f"--epp-profile {spec}: measured on {profile.device}, this run is on CUDA; use --epp-profile "
                         f"{AUTO_PROFILE} (a profile measured on this GPU), {ANALYTIC_PROFILE}, or a GPU profile "
                         "(python -m megatron_epp.measure.profile_gpu --out FILE)")


def shape_distance(a: ModelShape, b: ModelShape) -> tuple[int, float]:
    """How far apart two shapes are for the time coefficients: the architecture choices that differ
    (MLP, positions, norm, biases, dtype, grouped-query attention), then ``sum |log ratio|`` of the widths
    (hidden, FFN, query width, K/V width). Layers and vocabulary do not count (per layer; the head scales)."""
    kinds = sum(getattr(a, f) != getattr(b, f) for f in ("swiglu", "rope", "normalization", "bias", "dtype"))
    kinds += (a.num_kv_heads is None) != (b.num_kv_heads is None)
    widths = ((a.hidden, b.hidden), (a.ffn_hidden, b.ffn_hidden), (a.q_hidden, b.q_hidden), (a.kv_hidden, b.kv_hidden))
    return kinds, float(sum(abs(np.log(x / y)) for x, y in widths))


def nearest_cpu_profile(shape: ModelShape | None) -> Profile:
    """The shipped CPU profile measured nearest ``shape`` (:func:`shape_distance`; ties: file name), the
    test model's (``test-model_cpu.json``) without a shape. The planner then scales its times to ``shape``
    by FLOPs (:func:`shape_time`), which is exact at the shape it was measured at and drifts away from it
    (at hidden 128, hidden-64 coefficients over-predict real chunks by 8-40 %: docs/planner.md)."""
    if shape is None:
        return Profile.load(TEST_MODEL_PROFILE)
    profiles = [(path.name, Profile.load(path)) for path in sorted(PROFILE_DIR.glob("*_cpu.json"))]
    return min(profiles, key=lambda item: (shape_distance(item[1].time_model, shape), item[0]))[1]


def load_profile(spec: str, tp: int = 8, shape: ModelShape | None = None, device: str = "cpu") -> Profile:
    """A preset name (``llama-7b``/``llama-13b``/``llama-30b``: analytic H100 profile at ``tp``), ``analytic``
    (the analytic H100 profile of ``shape`` at ``tp``), ``cpu`` (the shipped CPU profile nearest ``shape``, the
    model that runs), ``test-model`` (the shipped CPU profile of the test model, hidden 64), ``auto`` (``cpu`` on
    the CPU; on CUDA resolved by the training driver, which measures: an error here) or a profile JSON path.
    ``device``: where the run is (``cpu``/``cuda``); a CPU-measured profile on ``cuda`` is an error."""
    if spec in MODEL_PRESETS:
        return analytic_profile(MODEL_PRESETS[spec], tp)
    if spec == ANALYTIC_PROFILE:
        if shape is None:
            raise ValueError(f"--epp-profile {ANALYTIC_PROFILE}: needs the model's shape (pretrain_gpt.py; epp-plan takes a preset)")
        return analytic_profile(shape, tp)
    if spec == AUTO_PROFILE and device == "cuda":
        raise ValueError(f"--epp-profile {AUTO_PROFILE} on CUDA: the profile is measured on the GPU at start-up "
                         "(megatron_epp.measure.profiling), not loaded")
    if spec in (CPU_PROFILES, AUTO_PROFILE):
        profile = nearest_cpu_profile(shape)
    elif spec == TEST_MODEL.name:
        profile = Profile.load(TEST_MODEL_PROFILE)
    else:
        path = Path(spec)
        if not path.exists():
            raise ValueError(f"--epp-profile {spec!r}: not a preset ({', '.join(PROFILE_NAMES)}) nor a file")
        profile = Profile.load(path)
    check_profile_device(profile, spec, device)
    return profile
