"""The planner's cost profile for this run: which one (``--epp-profile``), looked up, loaded or measured at start-up.

``--epp-profile auto`` (the default) on CUDA plans on a profile measured on *this* GPU for this dtype, attention
kernel, torch version, context cap and layer shape (:class:`~megatron_epp.cost.profile_lookup.ProfileKey`): the one in
the cache (``--epp-profile-cache``), else a shipped one, else one measured at start-up by the first rank (one layer of
the run's shape, a small grid, time-boxed to :data:`STARTUP_BUDGET_S`: :func:`~megatron_epp.measure.profiling.measure_profile`),
written to the cache atomically and sent to every rank. On the CPU ``auto`` is ``cpu`` (the shipped CPU profile nearest
the model). A CPU-measured profile on CUDA is refused (:func:`~megatron_epp.cost.profile_lookup.check_profile_device`).
Where no profile can be measured (a tensor-parallel run without a cached one; a grid left with too few points by
out-of-memory errors) the run plans on the analytic profile of its model, and its start-up line says why.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from megatron_epp.cost.analytic import analytic_profile
from megatron_epp.cost.profile import Profile
from megatron_epp.cost.profile_lookup import (
    AUTO_PROFILE, CPU_PROFILES, ProfileKey, default_profile_cache, find_measured_profile, kernel_cache_dir, load_profile,
)
from megatron_epp.cost.placement import place_profile, placement_note
from megatron_epp.base.dims import ParallelDims
from megatron_epp.cost.shape import MODEL_PRESETS, TEST_MODEL, ModelShape
from megatron_epp.executor import fused, kernels
from megatron_epp.config.errors import ArgumentError
from megatron_epp.model.gpt import attention_heads, fused_choice, model_shape, params_dtype
from megatron_epp.config.fields import TrainingConfig
from megatron_epp.measure.profiling import ProfileFailed, kernel_key, measure_profile, report_errors, report_memory, startup_grid

STARTUP_BUDGET_S = 60.0  # the start-up measurement's time box (optional grid points are dropped past it)


def run_device_type() -> str:
    """Where ``pretrain_gpt.py`` runs: ``cuda`` where a GPU is visible, else ``cpu`` (as ``initialize`` chooses)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Target:
    """What the profile is for: the run's device type (``cuda``/``cpu``) and dtype, and on CUDA the key's GPU name,
    attention kernel, fused kernels (:class:`~megatron_epp.executor.fused.FusedChoice`: a profile measured with other
    kernels is another key's) and torch version, and the torch device the start-up profiler measures on (tests
    measure "a GPU" on the CPU)."""

    device_type: str
    dtype: torch.dtype
    gpu: str = ""
    kernel: str = ""
    measure_on: torch.device = torch.device("cpu")
    torch_version: str = torch.__version__
    fused_kernels: fused.FusedChoice = fused.UNFUSED
    loss_chunk_tokens: int = 0  # the chunked output head's block (--epp-loss-chunk-tokens; 0: whole logits)
    mlp_chunk_tokens: int = 0  # the tiled MLP's block (--epp-mlp-chunk-tokens; 0: the whole chunk's MLP)

    @classmethod
    def of_run(cls, cfg: TrainingConfig, device: torch.device) -> "Target":
        """This run's: its device, its dtype (``--bf16``, ``--fp16``, else fp32) and the kernel the executor will run
        there (``--attention-backend``, else ``EPP_ATTENTION_BACKEND``; with or without GQA and attention dropout)."""
        dtype = params_dtype(cfg)
        if device.type != "cuda":
            return cls(device.type, dtype)
        heads = attention_heads(cfg)  # flash-attn-4's probe runs (and compiles) this rank's head shape
        kernel = kernels.select_backend(kernels.requested_backend(cfg.model.attention_backend), device, dtype,
                                        dropout=cfg.model.attention_dropout, gqa=heads[1] != heads[0], heads=heads,
                                        deterministic=cfg.model.deterministic_mode)
        return cls("cuda", dtype, torch.cuda.get_device_name(device), kernel, device,
                   fused_kernels=fused_choice(cfg, device, elastic=True), loss_chunk_tokens=cfg.epp.loss_chunk_tokens,
                   mlp_chunk_tokens=cfg.epp.mlp_chunk_tokens)

    @property
    def key_kernel(self) -> str:
        """The kernel part of the key: the attention kernel and the fused kernels' tag (:func:`kernel_key`)."""
        return kernel_key(self.kernel, self.fused_kernels, self.loss_chunk_tokens, self.mlp_chunk_tokens)

    def key(self, shape: ModelShape, seq_length: int) -> ProfileKey:
        return ProfileKey.of(self.gpu, str(self.dtype).removeprefix("torch."), self.key_kernel, shape, self.torch_version, seq_length)


@dataclass(frozen=True)
class Resolved:
    """The profile the planner uses, where it came from and, on CUDA under ``auto``, the key it was looked up by
    (for the start-up line)."""

    profile: Profile
    origin: str
    key: str = ""


def _load(cfg: TrainingConfig, device_type: str) -> Resolved:
    """A profile that is loaded, not measured: every ``--epp-profile`` but ``auto`` on CUDA."""
    spec, shape = cfg.epp.planner.profile, model_shape(cfg)
    profile = load_profile(spec, tp=cfg.parallel.dims.tp, shape=shape, device=device_type)
    origin = {AUTO_PROFILE: "the shipped CPU profile nearest the model", CPU_PROFILES: "the shipped CPU profile nearest the model",
              TEST_MODEL.name: "shipped"}.get(spec, "analytic" if spec in MODEL_PRESETS or profile.source == "analytic" else f"file {spec}")
    return Resolved(profile, origin)


def _measured_on_gpu(cfg: TrainingConfig, target: Target, cache_dir: Path, log: Callable[[str], None]) -> Resolved:
    """``auto`` on CUDA: the cache's (or a shipped) profile of this key, else one measured now and cached; the model's
    analytic profile, with the reason, where none can be measured: a TP > 1 run (the profiler measures a whole layer
    on one GPU), or a grid that runs out of memory below the points its fits need."""
    shape = model_shape(cfg)
    key = target.key(shape, cfg.model.seq_length)
    older: list[Path] = []
    found = find_measured_profile(key, cache_dir, older)
    if found is not None:
        path, profile = found
        return Resolved(profile, f"{'cache hit' if path.parent == cache_dir else 'shipped'} {path}", key.describe())
    ignored = f" ({len(older)} of an older key format ignored: {', '.join(p.name for p in older)})" if older else ""
    if cfg.parallel.dims.tp != 1:
        why = (f"no measured profile of this key in {cache_dir}{ignored}, and the start-up profiler measures a whole layer on one "
               f"GPU, not a TP {cfg.parallel.dims.tp} shard: the analytic profile of the model instead (python -m megatron_epp.measure.profile_gpu "
               f"with this model's flags and --epp-profile-cache {cache_dir} measures one ahead)")
        return Resolved(analytic_profile(shape, cfg.parallel.dims.tp), why, key.describe())
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ArgumentError(f"--epp-profile-cache {cache_dir}: {error}") from None
    log(f"> planner: no measured profile of {key.describe()} in {cache_dir}{ignored}: measuring one layer on this GPU "
        f"(at most ~{STARTUP_BUDGET_S:.0f} s)")
    t0 = time.perf_counter()
    try:
        profile = _measure_at_startup(cfg, target, shape, log)
    except Exception as error:  # noqa: BLE001  (out of memory, too few points, or a fault of the profiler: never the run's end)
        what = str(error).splitlines()[0][:200] if str(error) else ""
        if not isinstance(error, (ProfileFailed, torch.OutOfMemoryError)):
            what = f"{type(error).__name__}: {what}"
        why = f"the start-up profiler could not measure a profile ({what}): the analytic profile of the model instead"
        log(f"> planner: {why}")
        return Resolved(analytic_profile(shape, cfg.parallel.dims.tp), why, key.describe())
    path = cache_dir / key.file_name()
    profile.save(path)
    report_errors(profile, log)
    report_memory(profile, log)
    return Resolved(profile, f"cache miss, measured now in {time.perf_counter() - t0:.1f} s, cached at {path}", key.describe())


def _measure_at_startup(cfg: TrainingConfig, target: Target, shape: ModelShape, log: Callable[[str], None]) -> Profile:
    """:func:`measure_profile` on the start-up grid, the run's random states left as they were, the GPU's cache
    emptied after it (also after a failure)."""
    cuda = target.measure_on.type == "cuda"
    rng_tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker_states = rng_tracker.get_states()
    try:
        with torch.random.fork_rng(devices=[target.measure_on] if cuda else []):  # the run's seeds stay as they were
            return measure_profile(shape, target.measure_on, target.dtype, target.kernel, startup_grid(cfg.model.seq_length),
                                   name=f"{target.gpu} ({str(target.dtype).removeprefix('torch.')}, {target.key_kernel})",
                                   fused_kernels=target.fused_kernels,
                                   budget_s=STARTUP_BUDGET_S, rotary_base=cfg.model.rotary_base, log=log,
                                   note="measured at start-up by pretrain_gpt.py --epp-profile auto", seq_length=cfg.model.seq_length)
    finally:
        rng_tracker.set_states(tracker_states)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def configure_kernel_cache(cfg: TrainingConfig) -> str:
    """flash-attn-4's compile cache in the run's cache directory (``--epp-profile-cache``'s ``kernels/flash-attn-4``),
    before anything imports it: a variant compiled once (tens of seconds) is read back by later runs in well under a
    second. The start-up line's words for it."""
    return kernels.fa4.configure_compile_cache(kernel_cache_dir(cfg.epp.profile_cache))


def resolve_profile(cfg: TrainingConfig, target: Target, log: Callable[[str], None] = print) -> Resolved:
    """The profile ``cfg.epp.planner.profile`` names for ``target`` (see the module's doc), used at the run's TP size;
    a bad profile is an :class:`ArgumentError` (one line)."""
    cache_dir = Path(cfg.epp.profile_cache or default_profile_cache()).expanduser()
    try:
        if cfg.epp.planner.profile == AUTO_PROFILE and target.device_type == "cuda":
            resolved = _measured_on_gpu(cfg, target, cache_dir, log)
        else:
            resolved = _load(cfg, target.device_type)
        at_tp = ParallelDims(tp=cfg.parallel.dims.tp)  # the run's TP; the online planner places it at the run's CP
        profile, note = place_profile(resolved.profile, at_tp), placement_note(resolved.profile, at_tp)
    except (ValueError, OSError, KeyError, TypeError) as error:
        raise ArgumentError(str(error) if str(error).startswith("--epp-profile") else f"--epp-profile: {error}") from None
    return Resolved(profile, resolved.origin + (f"; {note}" if note else ""), resolved.key)


def describe(cfg: TrainingConfig, resolved: Resolved) -> str:
    """The start-up line: ``--epp-profile SPEC: measured|analytic on DEVICE (model NAME; where from[; key KEY])``."""
    p = resolved.profile
    key = f"; key {resolved.key}" if resolved.key else ""
    return f"--epp-profile {cfg.epp.planner.profile}: {p.source} on {p.device} (model {p.model.name}; {resolved.origin}{key})"


def loaded_profile(cfg: TrainingConfig) -> Resolved | None:
    """The run's profile where no measurement on this device is needed (a preset, a JSON file, ``auto`` on the CPU):
    resolved here, once, before any work (the same file on every rank), a bad one an :class:`ArgumentError`; None where
    ``auto`` on CUDA measures the profile (or finds it in the cache) after start-up (:func:`startup_profile`)."""
    if cfg.epp.planner.profile == AUTO_PROFILE and run_device_type() == "cuda":
        return None
    return resolve_profile(cfg, Target(run_device_type(), params_dtype(cfg)))


def startup_profile(cfg: TrainingConfig, device: torch.device, target: Target | None = None) -> Resolved:
    """After the process groups are up, before the model is built: the first rank resolves the profile (measuring
    it on CUDA when ``auto`` finds none) and sends it to every rank, which plans on it (the step builder hands it to
    :func:`~megatron_epp.training.planning.online_planner`); :func:`describe` is its start-up line. ``target``: tests only."""
    first = not dist.is_initialized() or dist.get_rank() == 0
    box: list = [None]
    if first:
        try:
            resolved = resolve_profile(cfg, target or Target.of_run(cfg, device))
            box = [("ok", resolved.profile.to_dict(), resolved.origin, resolved.key)]
        except ArgumentError as error:
            box = [("error", str(error), None, None)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    status, payload, origin, key = box[0]
    if status == "error":
        raise ArgumentError(payload)
    return Resolved(Profile.from_dict(payload), origin, key)


def profile_before_startup(cfg: TrainingConfig, loaded: Resolved | None) -> Profile:
    """The profile the planner plans on before start-up (the memory-budget check), at the run's TP size: the one
    :func:`loaded_profile` loaded, or where ``auto`` on CUDA measures after start-up (``loaded`` None) the analytic
    profile of the model (its memory Megatron's count; the measured profile has the allocator's, and the budget is
    checked again on it)."""
    return loaded.profile if loaded is not None else analytic_profile(model_shape(cfg), cfg.parallel.dims.tp)


def planner_profile(cfg: TrainingConfig) -> Profile:
    """:func:`profile_before_startup` of the run's profile: for what plans outside a run (replays, tests)."""
    return profile_before_startup(cfg, loaded_profile(cfg))
