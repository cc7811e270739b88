"""The planner's cost profile for this run: which one (``--epp-profile``), and measuring one on a GPU.

``--epp-profile auto`` (the default) on CUDA plans on a profile measured on *this* GPU for this dtype,
attention kernel and layer shape (:class:`~megatron_epp.cost.profiles.ProfileKey`): the one in the cache
(``--epp-profile-cache``), else a shipped one, else one measured at start-up by the first rank (one layer of
the run's shape, a small grid, time-boxed to :data:`STARTUP_BUDGET_S`), written to the cache atomically and
sent to every rank. On the CPU ``auto`` is ``cpu`` (the shipped CPU profile nearest the model). A CPU-measured
profile on CUDA is refused (:func:`~megatron_epp.cost.profiles.check_profile_device`).

The measurement (:func:`measure_profile`) is shared with ``scripts/profile_gpu.py``; the fits are
:mod:`megatron_epp.cost.profile_fit`'s (numpy).
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_epp.cost.profile_fit import attention_fit, head_fit, layer_fit, measured_profile
from megatron_epp.cost.profiles import (
    AUTO_PROFILE, CPU_PROFILES, MODEL_PRESETS, TEST_MODEL, MemoryCoeffs, ModelShape, Profile, ProfileKey, analytic_profile,
    default_profile_cache, find_measured_profile, gpu_activation_memory, load_profile, profile_at_tp, saved_tensor_memory,
)
from megatron_epp.executor import kernels
from megatron_epp.executor.context import ChunkContext, ChunkLayout, KVBuffer
from megatron_epp.executor.rotary import ChunkRotaryEmbedding
from megatron_epp.executor.spec import elastic_layer_spec
from megatron_epp.plan import Chunk, Segment
from megatron_epp.training.arguments import ROTARY_BASE, ArgumentError
from megatron_epp.training.model import architecture_config, elastic_base_layer_spec, model_shape
from megatron_epp.training.config import TrainingConfig

STARTUP_BUDGET_S = 60.0  # the start-up measurement's time box (optional grid points are dropped past it)
MAX_POSITIONS = 32768  # RoPE's table in a LayerStack unless the caller asks for more (measure_profile: its longest layer)


class LayerStack(torch.nn.Module):
    """``num_layers`` transformer layers of the training spec with prefix attention, plus the output head.

    The layers are built through the training spec (``elastic_base_layer_spec()`` passed through
    ``elastic_layer_spec``): ``ChunkRecomputeLayer`` with ``ElasticAttention`` as core attention, RoPE (when the
    shape has it) through the chunk rotary embedding, all reading the stack's own :class:`ChunkContext`. A
    checkpointed forward recomputes as training does (the layout's recompute count, megatron-core's
    ``tensor_parallel.checkpoint``). RoPE's table holds ``max_positions`` positions: a chunk past them is refused. Needs megatron-core's model-parallel state with one tensor-parallel rank
    (a training process at TP = 1, or ``megatron_epp.training.layer_bench.init_single_process``).

    :meth:`set_segments` makes a chunk current in the stack's own context until the next call, so a
    forward and its backward (recompute included) run on that chunk.
    """

    def __init__(self, shape: ModelShape, num_layers: int, seed: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, rotary_base: int = ROTARY_BASE, max_positions: int = MAX_POSITIONS) -> None:
        super().__init__()
        if parallel_state.get_tensor_model_parallel_world_size() != 1:
            raise RuntimeError("LayerStack: one tensor-parallel rank only (a layer at TP > 1 needs its peers)")
        torch.manual_seed(seed)
        self.device, self.dtype = torch.device(device), dtype
        on_cpu = self.device.type == "cpu"
        config = TransformerConfig(
            num_layers=num_layers,
            hidden_size=shape.hidden,
            num_attention_heads=shape.num_heads,
            ffn_hidden_size=shape.ffn_hidden,
            **architecture_config(swiglu=shape.swiglu, normalization=shape.normalization, num_query_groups=shape.num_kv_heads,
                                  kv_channels=shape.kv_channels, bias=shape.bias),
            use_cpu_initialization=on_cpu,  # else RoPE's frequencies are made on the current GPU
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        self.context = ChunkContext()
        spec = elastic_layer_spec(elastic_base_layer_spec(shape.normalization), self.context)
        self.layers = torch.nn.ModuleList(build_module(spec, config=config, layer_number=i + 1) for i in range(num_layers))
        self.rotary = ChunkRotaryEmbedding(RotaryEmbedding(config.kv_channels, rotary_percent=1.0, rotary_base=rotary_base,
                                                           use_cpu_initialization=on_cpu), self.context, max_positions) if shape.rope else None
        self.head = torch.nn.Linear(shape.hidden, shape.vocab, bias=False)
        self.shape = shape
        self._recompute_layout: ChunkLayout | None = None
        self._prefixes: list[tuple[KVBuffer, int]] = []  # each slice's buffers and their prefix rows
        self.to(self.device, dtype)  # every parameter, LayerNorms included, as Float16Module does in training
        if self.rotary is not None:
            self.rotary.build_table()  # once, as training builds it (fp32: a plain attribute, not cast)

    def set_segments(self, lengths: Sequence[int], contexts: Sequence[int]) -> None:
        """Make the segments ``(s, C)`` the current chunk; a slice of context ``C > 0`` (at most one, as
        in a plan) gets a K/V buffer per layer whose prefix rows ``[0, C)`` hold random K/V."""
        if sum(c > 0 for c in contexts) > 1:
            raise ValueError("a chunk holds at most one slice with context")
        heads, d = self.shape.num_kv_heads or self.shape.num_heads, self.shape.head_dim
        chunk = Chunk(0, "batched", [Segment(i, c, c + s) for i, (s, c) in enumerate(zip(lengths, contexts))])
        self.context.clear()
        self.context.current = ChunkLayout.build(chunk, [c + s for s, c in zip(lengths, contexts)], self.device)
        self._recompute_layout = dataclasses.replace(self.context.current, recompute=len(self.layers))
        self._prefixes = []
        for i, (s, c) in enumerate(zip(lengths, contexts)):
            for layer in self.layers if c else ():
                buffer = self.context.kv_buffer(i, layer.layer_number, c + s, torch.empty(0, 1, heads, d, device=self.device, dtype=self.dtype))
                buffer.write(0, *(torch.randn(c, 1, heads, d, device=self.device, dtype=self.dtype) for _ in range(2)))
                self._prefixes.append((buffer, c))

    def forward(self, x: torch.Tensor, checkpoint: bool = False) -> torch.Tensor:
        """Hidden states ``[s, 1, h]`` through every layer (each recomputing in backward if asked)."""
        for buffer, c in self._prefixes:
            buffer.written = c  # so that every timed forward writes its slice's K/V, as a first forward does
        with self.context.running(self._recompute_layout if checkpoint else self.context.layout()):
            rotary = self.rotary(x.shape[0]) if self.rotary is not None else None
            for layer in self.layers:
                x = layer(x, attention_mask=None, rotary_pos_emb=rotary)[0]
        return x

    def head_loss(self, x: torch.Tensor) -> torch.Tensor:
        """Output layer and summed cross entropy (fp32 logits) of hidden states ``[s, 1, h]``."""
        logits = self.head(x).float().view(-1, self.shape.vocab)
        return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device), reduction="sum")


class Timer:
    """Median ms of a forward and of its backward: CUDA events on a GPU; on the CPU this process's CPU time
    (``process_time``: with one thread it equals the wall time on an idle core, and other processes sharing the
    machine do not inflate it)."""

    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def _mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.process_time()

    def _ms(self, start, end) -> float:
        if self.device.type == "cuda":
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def _once(self, run: Callable[..., torch.Tensor], inputs: tuple) -> tuple[float, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = self._mark()
        out = run(*inputs)
        t1 = self._mark()
        (out if out.dim() == 0 else out.float().sum()).backward()
        t2 = self._mark()
        return self._ms(t0, t1), self._ms(t1, t2)

    def fwd_bwd(self, run: Callable[..., torch.Tensor], make_inputs: Callable[[], tuple]) -> tuple[float, float]:
        times = [self._once(run, make_inputs()) for _ in range(self.warmup + self.repeats)][self.warmup:]  # inputs made outside the timing
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

    def paired(self, run: Callable[..., torch.Tensor], other: Callable[..., torch.Tensor], make_inputs: Callable[[], tuple]) -> tuple[float, float, float]:
        """Median forward and backward ms of ``run``, and the median over repeats of ``other``'s forward +
        backward less ``run``'s, the two timed back to back in each repeat (a difference of two separate
        medians is as noisy as both)."""
        rows = []
        for i in range(self.warmup + self.repeats):
            f, b = self._once(run, make_inputs())
            fo, bo = self._once(other, make_inputs())
            if i >= self.warmup:
                rows.append((f, b, fo + bo - f - b))
        return tuple(statistics.median(r[j] for r in rows) for j in range(3))  # type: ignore[return-value]


@dataclass(frozen=True)
class ProfileGrid:
    """Where the profiler times: the attention kernel at ``(s, C)`` for ``seq_lengths`` x ``contexts``, one
    layer at ``layer_lengths`` (``C = 0``, plain and checkpointed), the output head at ``head_lengths``;
    ``warmup`` untimed and ``repeats`` timed runs (medians)."""

    seq_lengths: tuple[int, ...]
    contexts: tuple[int, ...]
    layer_lengths: tuple[int, ...]
    head_lengths: tuple[int, ...]
    warmup: int = 2
    repeats: int = 5

    def check(self) -> None:
        if min(self.seq_lengths + self.layer_lengths + self.head_lengths) < 1 or min(self.contexts) < 0:
            raise ValueError("the grid's lengths must be >= 1, its contexts >= 0")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("--repeats must be >= 1, --warmup >= 0")
        if len(set(self.layer_lengths)) < 3 or len(set(self.head_lengths)) < 2:
            raise ValueError("--layer-lengths needs 3 lengths at least (the recompute fits 3 terms), --head-lengths 2")
        if len(self.seq_lengths) * len(self.contexts) < 5:
            raise ValueError("the attention grid needs 5 (s, C) points at least (5 coefficients are fitted)")


def startup_grid(seq_length: int, min_length: int = 16) -> ProfileGrid:
    """The start-up profiler's small grid for a run whose longest chunk is ``seq_length`` tokens: the attention at
    1/16, 1/4 and 1/2 of it, over no prefix and half of it; the layer at 1/16, 1/4, 1/2 and all of it; the head
    at 1/16 and all of it (each at least ``min_length``); one warm-up, three repeats."""
    def at(*fractions: int) -> tuple[int, ...]:
        return tuple(sorted({max(min_length, seq_length // f) for f in fractions}))

    return ProfileGrid(at(16, 4, 2), (0, max(min_length, seq_length // 2)), at(16, 4, 2, 1), at(16, 1), warmup=1, repeats=3)


def memory_block(shape: ModelShape, dtype: torch.dtype) -> MemoryCoeffs:
    """What the planner counts for memory (not measured here): Megatron's bf16 activation count, or the CPU's
    fp32 saved-tensor count; model states as training keeps them (the planner replaces them by the run's)."""
    if dtype == torch.float32:
        return MemoryCoeffs(**saved_tensor_memory(shape, 1), weight=4.0, grad=4.0, optim=8.0, distributed_optimizer=False,
                            p2p_token=4.0 * shape.hidden, derive="saved-tensors")
    return MemoryCoeffs(**gpu_activation_memory(shape, 1), weight=2.0, grad=4.0, optim=12.0, distributed_optimizer=False,
                        p2p_token=2.0 * shape.hidden, derive="megatron-gpu")


def device_name(device: torch.device, dtype: torch.dtype, kernel: str, gpu: str | None = None) -> str:
    """A measured profile's ``device``: ``"GPU name (dtype, kernel)"`` (what :class:`ProfileKey` reads back), or
    ``"CPU arch (N thread, dtype, kernel)"`` on the CPU, unless ``gpu`` names the device."""
    what = f"{str(dtype).removeprefix('torch.')}, {kernel}"
    if gpu is not None or device.type == "cuda":
        return f"{gpu or torch.cuda.get_device_name(device)} ({what})"
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} thread, {what})"


def measure_profile(shape: ModelShape, device: torch.device, dtype: torch.dtype, kernel: str, grid: ProfileGrid, *,
                    name: str | None = None, budget_s: float | None = None, rotary_base: int = ROTARY_BASE,
                    log: Callable[[str], None] = print, note: str = "") -> Profile:
    """Time the attention kernel, one layer and the output head of ``shape`` on ``device`` in ``dtype`` over
    ``grid``, fit the cost model (:mod:`megatron_epp.cost.profile_fit`) and return the measured profile, its fits'
    errors in ``fit["errors"]``. ``name``: its ``device`` (default :func:`device_name`). ``budget_s``: a time box;
    past it each part keeps only the points its fit needs (5 attention, 3 layer, 2 head points; the rest are
    listed in ``fit["skipped"]``). Every point is logged as one line."""
    grid.check()
    shape = dataclasses.replace(shape, dtype=str(dtype).removeprefix("torch."))
    timer, t_start, skipped = Timer(device, grid.warmup, grid.repeats), time.perf_counter(), []

    def over(done: int, needed: int, what: str) -> bool:
        late = budget_s is not None and done >= needed and time.perf_counter() - t_start > budget_s
        if late:
            skipped.append(what)
        return late

    heads, kv_heads, d = shape.num_heads, shape.num_kv_heads or shape.num_heads, shape.head_dim
    run_kernel, scale = kernels.BACKENDS[kernel], 1.0 / d**0.5
    points, af, ab = [], [], []
    for s in grid.seq_lengths:
        for c in grid.contexts:
            if over(len(points), 5, f"attention s={s} C={c}"):
                continue
            chunk = Chunk(0, "split" if c else "batched", [Segment(0, c, c + s)])
            layout = ChunkLayout.build(chunk, [c + s], device)

            def make(s: int = s, c: int = c) -> tuple[torch.Tensor, ...]:
                # the queries; a slice's K/V rows as its buffer holds them: the prefix's c rows, then its own s
                return tuple(torch.randn(n, 1, h, d, device=device, dtype=dtype, requires_grad=True)
                             for n, h in ((s, heads), (c + s, kv_heads), (c + s, kv_heads)))

            def run(q, k_rows, v_rows, layout: ChunkLayout = layout, c: int = c) -> torch.Tensor:
                return run_kernel(q, k_rows[c:], v_rows[c:], layout, (k_rows, v_rows) if c else None, 0.0, scale)

            f, b = timer.fwd_bwd(run, make)
            points.append((s, c))
            af.append(f)
            ab.append(b)
            log(f"  attention s={s:6d} C={c:6d}: fwd {f:8.3f} ms  bwd {b:8.3f} ms")
    attention = attention_fit(points, af, ab)

    stack = LayerStack(shape, num_layers=1, device=device, dtype=dtype, rotary_base=rotary_base, max_positions=max(grid.layer_lengths))
    lengths, tf, tb, trc = [], [], [], []
    for s in grid.layer_lengths:
        if over(len(lengths), 3, f"layer s={s}"):
            continue
        stack.set_segments([s], [0])
        x = lambda s=s: (torch.randn(s, 1, shape.hidden, device=device, dtype=dtype, requires_grad=True),)  # noqa: E731
        f, b, rc = timer.paired(stack, lambda t: stack(t, checkpoint=True), x)
        lengths.append(s)
        tf.append(f)
        tb.append(b)
        trc.append(max(rc, 1e-6))
        log(f"  layer s={s:6d}: fwd {f:8.3f} ms  bwd {b:8.3f} ms  recompute {trc[-1]:8.3f} ms")
    layer = layer_fit(lengths, tf, tb, trc, attention["attention_fwd"][0], attention["attention_bwd"][0])

    head_lengths, hf, hb = [], [], []
    for s in grid.head_lengths:
        if over(len(head_lengths), 2, f"head s={s}"):
            continue
        f, b = timer.fwd_bwd(stack.head_loss, lambda s=s: (torch.randn(s, 1, shape.hidden, device=device, dtype=dtype, requires_grad=True),))
        head_lengths.append(s)
        hf.append(f)
        hb.append(b)
        log(f"  head s={s:6d}: fwd {f:8.3f} ms  bwd {b:8.3f} ms")
    head = head_fit(head_lengths, hf, hb)
    del stack
    errors = {k: v[1] for k, v in {**attention, **layer, **head}.items()}
    dtype_name = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))
    info = {"errors": errors, "torch": torch.__version__, "kernel": kernel, "dtype": dtype_name,
            "grid": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(grid).items()}, "seconds": round(time.perf_counter() - t_start, 2), "skipped": skipped,
            "timings": {"attention": [[s, c, f, b] for (s, c), f, b in zip(points, af, ab)],
                        "layer": [list(r) for r in zip(lengths, tf, tb, trc)], "head": [list(r) for r in zip(head_lengths, hf, hb)]},
            "note": "medians; CUDA events on GPU, process CPU time on CPU; memory not measured" + (f"; {note}" if note else "")}
    return measured_profile(shape, name or device_name(device, dtype, kernel), layer, head, memory_block(shape, dtype), info)


def report_errors(profile: Profile, log: Callable[[str], None] = print) -> None:
    """One line per fit: its rms and max relative error."""
    for key, e in profile.fit["errors"].items():
        log(f"  {key:14s} rms rel err {e['rms_rel_err'] * 100:6.2f} %   max {e['max_rel_err'] * 100:6.2f} %   ({e['points']} points)")


# --- which profile this run plans on -------------------------------------------------------------------------------

def run_device_type() -> str:
    """Where ``pretrain_gpt.py`` runs: ``cuda`` where a GPU is visible, else ``cpu`` (as ``initialize`` chooses)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Target:
    """What the profile is for: the run's device type (``cuda``/``cpu``), and on CUDA the key's GPU name, dtype and
    attention kernel, and the torch device the start-up profiler measures on (tests measure "a GPU" on the CPU)."""

    device_type: str
    dtype: torch.dtype
    gpu: str = ""
    kernel: str = ""
    measure_on: torch.device = torch.device("cpu")

    @classmethod
    def of_run(cls, cfg: TrainingConfig, device: torch.device) -> "Target":
        """This run's: its device, dtype and the kernel the executor will run there (``EPP_ATTENTION_BACKEND``)."""
        dtype = torch.bfloat16 if cfg.model.bf16 else torch.float32
        if device.type != "cuda":
            return cls(device.type, dtype)
        kernel = kernels.select_backend(kernels.requested_backend(), device, dtype, dropout=cfg.model.attention_dropout)
        return cls("cuda", dtype, torch.cuda.get_device_name(device), kernel, device)

    def key(self, shape: ModelShape) -> ProfileKey:
        return ProfileKey.of(self.gpu, str(self.dtype).removeprefix("torch."), self.kernel, shape)


@dataclass(frozen=True)
class Resolved:
    """The profile the planner uses and where it came from (for the start-up line)."""

    profile: Profile
    origin: str


def _load(cfg: TrainingConfig, device_type: str) -> Resolved:
    """A profile that is loaded, not measured: every ``--epp-profile`` but ``auto`` on CUDA."""
    spec, shape = cfg.epp.planner.profile, model_shape(cfg)
    profile = load_profile(spec, tp=cfg.parallel.dims.tp, shape=shape, device=device_type)
    origin = {AUTO_PROFILE: "the shipped CPU profile nearest the model", CPU_PROFILES: "the shipped CPU profile nearest the model",
              TEST_MODEL.name: "shipped"}.get(spec, "analytic" if spec in MODEL_PRESETS or profile.source == "analytic" else f"file {spec}")
    return Resolved(profile, origin)


def _measured_on_gpu(cfg: TrainingConfig, target: Target, cache_dir: Path, log: Callable[[str], None]) -> Resolved:
    """``auto`` on CUDA: the cache's (or a shipped) profile of this key, else one measured now and cached."""
    shape = model_shape(cfg)
    key = target.key(shape)
    found = find_measured_profile(key, cache_dir)
    if found is not None:
        path, profile = found
        return Resolved(profile, f"{'cache hit' if path.parent == cache_dir else 'shipped'} {path}")
    if cfg.parallel.dims.tp != 1:
        raise ArgumentError(f"--epp-profile {AUTO_PROFILE}: no profile of {key.describe()} in {cache_dir}, and the start-up "
                            f"profiler measures one GPU (TP 1) only: run scripts/profile_gpu.py with this model's flags "
                            f"(--epp-profile-cache {cache_dir}), or use --epp-profile analytic")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ArgumentError(f"--epp-profile-cache {cache_dir}: {error}") from None
    log(f"> planner: no measured profile of {key.describe()} in {cache_dir}: measuring one layer on this GPU "
        f"(at most ~{STARTUP_BUDGET_S:.0f} s)")
    t0 = time.perf_counter()
    cuda = target.measure_on.type == "cuda"
    rng_tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker_states = rng_tracker.get_states()
    with torch.random.fork_rng(devices=[target.measure_on] if cuda else []):  # the run's seeds stay as they were
        profile = measure_profile(shape, target.measure_on, target.dtype, target.kernel, startup_grid(cfg.model.seq_length),
                                  name=f"{target.gpu} ({str(target.dtype).removeprefix('torch.')}, {target.kernel})",
                                  budget_s=STARTUP_BUDGET_S, rotary_base=cfg.model.rotary_base, log=log,
                                  note="measured at start-up by pretrain_gpt.py --epp-profile auto")
    rng_tracker.set_states(tracker_states)
    if cuda:
        torch.cuda.empty_cache()
    path = cache_dir / key.file_name()
    profile.save(path)
    report_errors(profile, log)
    return Resolved(profile, f"cache miss, measured now in {time.perf_counter() - t0:.1f} s, cached at {path}")


def resolve_profile(cfg: TrainingConfig, target: Target, log: Callable[[str], None] = print) -> Resolved:
    """The profile ``cfg.epp.planner.profile`` names for ``target`` (see the module's doc), used at the run's TP size;
    a bad profile is an :class:`ArgumentError` (one line)."""
    cache_dir = Path(cfg.epp.profile_cache or default_profile_cache()).expanduser()
    try:
        if cfg.epp.planner.profile == AUTO_PROFILE and target.device_type == "cuda":
            resolved = _measured_on_gpu(cfg, target, cache_dir, log)
        else:
            resolved = _load(cfg, target.device_type)
        profile, note = profile_at_tp(resolved.profile, cfg.parallel.dims.tp)
    except (ValueError, OSError, KeyError, TypeError) as error:
        raise ArgumentError(str(error) if str(error).startswith("--epp-profile") else f"--epp-profile: {error}") from None
    return Resolved(profile, resolved.origin + (f"; {note}" if note else ""))


def describe(cfg: TrainingConfig, resolved: Resolved) -> str:
    """The start-up line: ``--epp-profile SPEC: measured|analytic on DEVICE (model NAME; where from)``."""
    p = resolved.profile
    return f"--epp-profile {cfg.epp.planner.profile}: {p.source} on {p.device} (model {p.model.name}; {resolved.origin})"


def check_profile(cfg: TrainingConfig) -> None:
    """Before any work: a profile that is loaded (not measured on this GPU) loads and suits this device and TP."""
    if not (cfg.epp.planner.profile == AUTO_PROFILE and run_device_type() == "cuda"):
        resolve_profile(cfg, Target(run_device_type(), torch.float32))


def startup_profile(cfg: TrainingConfig, device: torch.device, target: Target | None = None) -> Resolved:
    """After the process groups are up, before the model is built: the first rank resolves the profile (measuring
    it on CUDA when ``auto`` finds none) and sends it to every rank, which plans on it (the step builder hands it to
    :func:`~megatron_epp.training.planning.online_planner`); :func:`describe` is its start-up line. ``target``: tests only."""
    first = not dist.is_initialized() or dist.get_rank() == 0
    box: list = [None]
    if first:
        try:
            resolved = resolve_profile(cfg, target or Target.of_run(cfg, device))
            box = [("ok", resolved.profile.to_dict(), resolved.origin)]
        except ArgumentError as error:
            box = [("error", str(error), None)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    status, payload, origin = box[0]
    if status == "error":
        raise ArgumentError(payload)
    return Resolved(Profile.from_dict(payload), origin)


def planner_profile(cfg: TrainingConfig) -> Profile:
    """The profile the planner plans on before :func:`startup_profile` resolved the run's (the memory-budget check
    before start-up), at the run's TP size: ``auto`` on CUDA takes the analytic profile of the model, whose memory
    coefficients are those of any GPU profile (GPU activation memory is derived, ``megatron-gpu``, not measured), and
    any other ``--epp-profile`` loads as it will."""
    if cfg.epp.planner.profile == AUTO_PROFILE and run_device_type() == "cuda":
        return analytic_profile(model_shape(cfg), cfg.parallel.dims.tp)
    return resolve_profile(cfg, Target(run_device_type(), torch.float32)).profile
