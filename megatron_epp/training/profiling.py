"""The planner's cost profile for this run: which one (``--epp-profile``), and measuring one on a GPU.

``--epp-profile auto`` (the default) on CUDA plans on a profile measured on *this* GPU for this dtype, attention
kernel, torch version, context cap and layer shape (:class:`~megatron_epp.cost.profiles.ProfileKey`): the one in the
cache (``--epp-profile-cache``), else a shipped one, else one measured at start-up by the first rank (one layer of
the run's shape, a small grid, time-boxed to :data:`STARTUP_BUDGET_S`), written to the cache atomically and sent to
every rank. On the CPU ``auto`` is ``cpu`` (the shipped CPU profile nearest the model). A CPU-measured profile on
CUDA is refused (:func:`~megatron_epp.cost.profiles.check_profile_device`). Where no profile can be measured (a
tensor-parallel run without a cached one; a grid left with too few points by out-of-memory errors) the run plans
on the analytic profile of its model, and its start-up line says why.

The measurement (:func:`measure_profile`) is shared with ``scripts/profile_gpu.py``: the time of each grid point and
the memory its layer and output head keep (a GPU's caching allocator; on the CPU what autograd saves); the fits are
:mod:`megatron_epp.cost.profile_fit`'s (numpy).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import psutil
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_epp.cost.profile_fit import attention_fit, head_fit, layer_fit, measured_memory, measured_profile
from megatron_epp.cost.profiles import (
    AUTO_PROFILE, CPU_PROFILES, DTYPE_BYTES, MODEL_PRESETS, TEST_MODEL, ModelShape, Profile, ProfileKey, analytic_profile,
    default_profile_cache, find_measured_profile, load_profile, profile_at_tp,
)
from megatron_epp.executor import kernels
from megatron_epp.executor.context import ChunkContext, ChunkLayout, KVBuffer
from megatron_epp.executor.memory_tracker import ActivationMemoryTracker
from megatron_epp.executor.rotary import ChunkRotaryEmbedding
from megatron_epp.executor.spec import elastic_layer_spec
from megatron_epp.plan import Chunk, Segment
from megatron_epp.training.arguments import ROTARY_BASE, ArgumentError
from megatron_epp.training.model import TorchNorm, architecture_config, elastic_base_layer_spec, model_shape, params_dtype
from megatron_epp.training.config import TrainingConfig

STARTUP_BUDGET_S = 60.0  # the start-up measurement's time box (optional grid points are dropped past it)
# the most of the device's free memory the output head's largest profile point may take (its logits and their
# gradient, :func:`head_bytes_per_token`): a 128K vocabulary at 64K tokens would need 32 GiB of fp32 logits alone
HEAD_MEMORY_SHARE = 0.5
MAX_POSITIONS = 32768  # RoPE's table in a LayerStack unless the caller asks for more (measure_profile: its longest layer)


class LayerStack(torch.nn.Module):
    """``num_layers`` transformer layers of the training spec with prefix attention, plus the output head.

    The layers are built through the training spec (``elastic_base_layer_spec()`` passed through
    ``elastic_layer_spec``): ``ChunkRecomputeLayer`` with ``ElasticAttention`` as core attention, RoPE (when the
    shape has it) through the chunk rotary embedding, all reading the stack's own :class:`ChunkContext`. A
    checkpointed forward recomputes as training does (the layout's recompute count, megatron-core's
    ``tensor_parallel.checkpoint``). The head is the last stage's as training builds it: the final norm, the
    column-parallel output layer and megatron-core's cross entropy, times a loss mask. RoPE's table holds ``max_positions``
    positions: a chunk past them is refused. Needs megatron-core's
    model-parallel state with one tensor-parallel rank (a training process at TP = 1, or
    ``megatron_epp.training.layer_bench.init_single_process``).

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
            fp16=dtype == torch.float16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            gradient_accumulation_fusion=False,
        )
        self.context = ChunkContext()
        spec = elastic_layer_spec(elastic_base_layer_spec(shape.normalization), self.context)
        self.layers = torch.nn.ModuleList(build_module(spec, config=config, layer_number=i + 1) for i in range(num_layers))
        self.rotary = ChunkRotaryEmbedding(RotaryEmbedding(config.kv_channels, rotary_percent=1.0, rotary_base=rotary_base,
                                                           use_cpu_initialization=on_cpu), self.context, max_positions) if shape.rope else None
        self.final_norm = TorchNorm(config, shape.hidden, eps=config.layernorm_epsilon)
        self.head = tensor_parallel.ColumnParallelLinear(shape.hidden, shape.vocab, config=config, init_method=config.init_method,
                                                         bias=False, gather_output=False)
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
        """The last stage's head on hidden states ``[s, 1, h]``: final norm, output layer, megatron-core's vocab-parallel
        cross entropy (fp32 softmax) against label 0, summed under a loss mask of ones (as training's per-token loss)."""
        logits, _ = self.head(self.final_norm(x))
        labels = torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device)
        losses = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
        mask = torch.ones(x.shape[0], dtype=torch.float32, device=x.device)
        return (losses.float().reshape(-1) * mask).sum()


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


class MemoryMeter:
    """What a forward keeps for its backward, and the most it holds during forward + backward, in bytes above what
    was allocated before it: on a GPU the caching allocator's ``memory_allocated`` after the forward and
    ``max_memory_allocated`` during both; on the CPU the tensors autograd saves
    (:class:`~megatron_epp.executor.memory_tracker.ActivationMemoryTracker`, deduplicated by storage; the peak is
    not measured there). The input is cloned inside the measurement, so it counts where the layer keeps it, as
    the output of the layer before it does in a model."""

    def __init__(self, device: torch.device, context: ChunkContext) -> None:
        self.device, self.context = device, context

    @staticmethod
    def _loss(run: Callable[..., torch.Tensor], inputs: tuple) -> torch.Tensor:
        out = run(*(t.clone() for t in inputs))
        return out if out.dim() == 0 else out.float().sum()

    def measure(self, run: Callable[..., torch.Tensor], make_inputs: Callable[[], tuple]) -> tuple[int, int | None]:
        """``(kept, peak)`` of one forward and backward of ``run(*make_inputs())``; ``peak`` None on the CPU."""
        inputs = make_inputs()
        if self.device.type != "cuda":
            with ActivationMemoryTracker(self.device, self.context) as tracker:
                loss = self._loss(run, inputs)
                kept = tracker.held_bytes
            loss.backward()
            return kept, None
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        start = torch.cuda.memory_allocated(self.device)
        loss = self._loss(run, inputs)
        kept = torch.cuda.memory_allocated(self.device) - start
        loss.backward()
        torch.cuda.synchronize(self.device)
        return kept, torch.cuda.max_memory_allocated(self.device) - start


class ProfileFailed(RuntimeError):
    """A part of the grid kept fewer points than its fit needs (out-of-memory errors): no profile was made."""


class Measurement:
    """One profiler run: its timer, the time box, and the grid points left out, past the time box
    (``skipped``) or out of memory (``out_of_memory``), each said in one line."""

    def __init__(self, device: torch.device, grid: ProfileGrid, budget_s: float | None, log: Callable[[str], None]) -> None:
        self.device, self.budget_s, self.log = device, budget_s, log
        self.timer = Timer(device, grid.warmup, grid.repeats)
        self.t_start = time.perf_counter()
        self.skipped: list[str] = []
        self.out_of_memory: list[str] = []

    def late(self, done: int, needed: int, what: str) -> bool:
        """True where the time box is spent and the part already has the ``needed`` points its fit takes (it has
        ``done``): ``what`` is then left out, recorded as skipped."""
        late = self.budget_s is not None and done >= needed and time.perf_counter() - self.t_start > self.budget_s
        if late:
            self.skipped.append(what)
        return late

    def point(self, what: str, measure: Callable[[], tuple]) -> tuple | None:
        """``measure()``, or None where it ran out of memory (``torch.OutOfMemoryError``): the point is left out with
        one line, its tensors released and the allocator's cache emptied."""
        try:
            return measure()
        except torch.OutOfMemoryError as error:
            reason = (str(error).strip().splitlines() or ["out of memory"])[0]
        gc.collect()  # the error and its frames are gone here: what the point allocated can be freed
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.out_of_memory.append(what)
        self.log(f"  {what}: out of memory, left out ({reason[:160]})")
        return None

    def enough(self, part: str, done: int, needed: int) -> None:
        if done < needed:
            raise ProfileFailed(f"the {part} kept {done} grid points of the {needed} its fit needs (out of memory at "
                                f"{', '.join(self.out_of_memory) or 'none'})")


def device_name(device: torch.device, dtype: torch.dtype, kernel: str, gpu: str | None = None) -> str:
    """A measured profile's ``device``: ``"GPU name (dtype, kernel)"`` (what :class:`ProfileKey` reads back), or
    ``"CPU arch (N thread, dtype, kernel)"`` on the CPU, unless ``gpu`` names the device."""
    what = f"{str(dtype).removeprefix('torch.')}, {kernel}"
    if gpu is not None or device.type == "cuda":
        return f"{gpu or torch.cuda.get_device_name(device)} ({what})"
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} thread, {what})"


def free_memory(device: torch.device) -> float:
    """Bytes free on ``device``: the GPU's (``mem_get_info``, the allocator's cached blocks released first), or the
    host's available memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return float(torch.cuda.mem_get_info(device)[0])
    return float(psutil.virtual_memory().available)


def head_bytes_per_token(shape: ModelShape) -> float:
    """What the output head holds per token at its peak, bounded: the fp32 logits and their fp32 gradient, and the
    logits and their gradient in the activations' dtype."""
    return shape.vocab * (8.0 + 2.0 * DTYPE_BYTES[shape.dtype])


def head_lengths_within(lengths: Sequence[int], shape: ModelShape, free_bytes: float, log: Callable[[str], None]) -> tuple[int, ...]:
    """The head's grid lengths whose logits fit :data:`HEAD_MEMORY_SHARE` of ``free_bytes``: a longer one is measured
    at the longest that fits instead (its time is linear in tokens: two lengths fit it), and the change is said in
    one line; at least two lengths where two fit at all."""
    cap = int(HEAD_MEMORY_SHARE * free_bytes // head_bytes_per_token(shape))
    kept = sorted({min(s, cap) for s in lengths if min(s, cap) >= 1})
    if len(kept) < 2 and cap >= 2:
        kept = sorted({max(1, cap // 16), cap})
    if tuple(kept) != tuple(sorted(set(lengths))):
        log(f"  head: lengths {', '.join(map(str, sorted(set(lengths))))} -> {', '.join(map(str, kept)) or 'none'} (the logits of "
            f"{cap + 1} tokens, {head_bytes_per_token(shape):,.0f} B a token at vocabulary {shape.vocab}, would take over "
            f"{HEAD_MEMORY_SHARE:.0%} of the {free_bytes / 2**30:.1f} GiB free)")
    return tuple(kept)


def _measure_attention(m: Measurement, shape: ModelShape, device: torch.device, dtype: torch.dtype, kernel: str,
                       grid: ProfileGrid) -> tuple[dict, list]:
    """The attention kernel's time over the grid's ``(s, C)`` points, fitted (:func:`attention_fit`), and the timings."""
    heads, kv_heads, d = shape.num_heads, shape.num_kv_heads or shape.num_heads, shape.head_dim
    run_kernel, scale = kernels.BACKENDS[kernel], 1.0 / d**0.5

    def timed(s: int, c: int) -> tuple[float, float]:
        layout = ChunkLayout.build(Chunk(0, "split" if c else "batched", [Segment(0, c, c + s)]), [c + s], device)

        def make() -> tuple[torch.Tensor, ...]:
            # the queries; a slice's K/V rows as its buffer holds them: the prefix's c rows, then its own s
            return tuple(torch.randn(n, 1, h, d, device=device, dtype=dtype, requires_grad=True)
                         for n, h in ((s, heads), (c + s, kv_heads), (c + s, kv_heads)))

        def run(q, k_rows, v_rows) -> torch.Tensor:
            return run_kernel(q, k_rows[c:], v_rows[c:], layout, (k_rows, v_rows) if c else None, 0.0, scale)

        return m.timer.fwd_bwd(run, make)

    points, af, ab = [], [], []
    for s in grid.seq_lengths:
        for c in grid.contexts:
            what = f"attention s={s} C={c}"
            if m.late(len(points), 5, what) or (row := m.point(what, lambda s=s, c=c: timed(s, c))) is None:
                continue
            points.append((s, c))
            af.append(row[0])
            ab.append(row[1])
            m.log(f"  attention s={s:6d} C={c:6d}: fwd {row[0]:8.3f} ms  bwd {row[1]:8.3f} ms")
    m.enough("attention", len(points), 5)
    return attention_fit(points, af, ab), [[s, c, f, b] for (s, c), f, b in zip(points, af, ab)]


def _measure_layer(m: Measurement, stack: LayerStack, lengths: Sequence[int], attention: dict) -> tuple[dict, dict, list]:
    """One layer at each of ``lengths`` (``C = 0``): its time plain and checkpointed (:func:`layer_fit`), the bytes it
    keeps for its backward (and its peak) both ways, and the timings."""
    meter, shape = MemoryMeter(stack.device, stack.context), stack.shape
    checkpointed = functools.partial(stack, checkpoint=True)
    rows: dict[str, list] = {k: [] for k in ("lengths", "fwd", "bwd", "recompute", "kept", "peak", "ckpt_kept", "ckpt_peak")}
    for s in lengths:
        what = f"layer s={s}"
        if m.late(len(rows["lengths"]), 3, what):
            continue
        stack.set_segments([s], [0])
        x = functools.partial(_hidden, s, shape.hidden, stack.device, stack.dtype)
        row = m.point(what, lambda: (*m.timer.paired(stack, checkpointed, x), *meter.measure(stack, x), *meter.measure(checkpointed, x)))
        if row is None:
            continue
        for key, value in zip(rows, (s, row[0], row[1], max(row[2], 1e-6), *row[3:])):
            rows[key].append(value)
        m.log(f"  layer s={s:6d}: fwd {row[0]:8.3f} ms  bwd {row[1]:8.3f} ms  recompute {rows['recompute'][-1]:8.3f} ms  "
              f"keeps {row[3] / s:,.0f} B/token ({row[5] / s:,.0f} checkpointed)")
    m.enough("layer", len(rows["lengths"]), 3)
    layer = layer_fit(rows["lengths"], rows["fwd"], rows["bwd"], rows["recompute"], attention["attention_fwd"][0], attention["attention_bwd"][0])
    memory = {k: rows[k] for k in ("lengths", "kept", "peak", "ckpt_kept", "ckpt_peak")}
    for key in ("peak", "ckpt_peak"):  # not measured on the CPU
        memory[key] = None if None in rows[key] else rows[key]
    return layer, memory, [list(r) for r in zip(*(rows[k] for k in ("lengths", "fwd", "bwd", "recompute")))]


def _measure_head(m: Measurement, stack: LayerStack, lengths: Sequence[int]) -> tuple[dict, dict, list]:
    """The output head at each of ``lengths``: its time (:func:`head_fit`), the bytes it keeps for its backward, and
    the timings."""
    meter = MemoryMeter(stack.device, stack.context)
    rows: dict[str, list] = {"lengths": [], "fwd": [], "bwd": [], "kept": []}
    for s in lengths:
        what = f"head s={s}"
        if m.late(len(rows["lengths"]), 2, what):
            continue
        x = functools.partial(_hidden, s, stack.shape.hidden, stack.device, stack.dtype)
        row = m.point(what, lambda: (*m.timer.fwd_bwd(stack.head_loss, x), meter.measure(stack.head_loss, x)[0]))
        if row is None:
            continue
        for key, value in zip(rows, (s, *row)):
            rows[key].append(value)
        m.log(f"  head s={s:6d}: fwd {row[0]:8.3f} ms  bwd {row[1]:8.3f} ms  keeps {row[2] / s:,.0f} B/token")
    m.enough("head", len(rows["lengths"]), 2)
    timings = [list(r) for r in zip(rows["lengths"], rows["fwd"], rows["bwd"])]
    return head_fit(rows["lengths"], rows["fwd"], rows["bwd"]), {"lengths": rows["lengths"], "kept": rows["kept"]}, timings


def _hidden(s: int, hidden: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor]:
    return (torch.randn(s, 1, hidden, device=device, dtype=dtype, requires_grad=True),)


def measure_profile(shape: ModelShape, device: torch.device, dtype: torch.dtype, kernel: str, grid: ProfileGrid, *,
                    name: str | None = None, budget_s: float | None = None, rotary_base: int = ROTARY_BASE,
                    log: Callable[[str], None] = print, note: str = "", seq_length: int | None = None) -> Profile:
    """Time the attention kernel, one layer and the output head of ``shape`` on ``device`` in ``dtype`` over ``grid``,
    measure the memory the layer (plain and checkpointed) and the head keep (:class:`MemoryMeter`), fit the cost
    model and the memory per token (:mod:`megatron_epp.cost.profile_fit`) and return the measured profile: its
    fits' errors in ``fit["errors"]``, the memory's in ``fit["memory"]``, its memory block ``derive`` ``"measured"``.
    ``name``: its ``device`` (default :func:`device_name`). ``seq_length``: the context cap it is for (its key's;
    default the grid's longest layer). ``budget_s``: a time box; past it each part keeps only the points its fit
    needs (5 attention, 3 layer, 2 head points; the rest are listed in ``fit["skipped"]``). The head's lengths are
    bounded by the device's free memory (:func:`head_lengths_within`); a point that runs out of memory is left out
    (``fit["out_of_memory"]``), and a part left with too few points raises :class:`ProfileFailed`. Every point is
    logged as one line."""
    grid.check()
    # as the stack measures it: in ``dtype``, without dropout (a run's dropout masks are carried by the basis count)
    shape = dataclasses.replace(shape, dtype=str(dtype).removeprefix("torch."), hidden_dropout=0.0, attention_dropout=0.0)
    m, timings = Measurement(device, grid, budget_s, log), {}
    attention, timings["attention"] = _measure_attention(m, shape, device, dtype, kernel, grid)
    stack = LayerStack(shape, num_layers=1, device=device, dtype=dtype, rotary_base=rotary_base,
                       max_positions=max(grid.layer_lengths))
    layer, layer_memory, timings["layer"] = _measure_layer(m, stack, grid.layer_lengths, attention)
    head_lengths = head_lengths_within(grid.head_lengths, shape, free_memory(device), log)
    head, head_memory, timings["head"] = _measure_head(m, stack, head_lengths)
    del stack
    memory, memory_fit = measured_memory(shape, device.type, layer_memory, head_memory)
    errors = {k: v[1] for k, v in {**attention, **layer, **head}.items()}
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))
    info = {"errors": errors, "torch": torch.__version__, "kernel": kernel, "dtype": dtype_name,
            "seq_length": int(seq_length or max(grid.layer_lengths)),
            "grid": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(grid).items()},
            "seconds": round(time.perf_counter() - m.t_start, 2), "skipped": m.skipped, "out_of_memory": m.out_of_memory,
            "memory": memory_fit,
            "note": ("medians; CUDA events and the caching allocator on GPU, process CPU time and autograd's saved tensors on "
                     "CPU") + (f"; {note}" if note else "")}
    return measured_profile(shape, name or device_name(device, dtype, kernel), layer, head, memory, {**info, "timings": timings})


def report_errors(profile: Profile, log: Callable[[str], None] = print) -> None:
    """One line per fit: its rms and max relative error."""
    for key, e in profile.fit["errors"].items():
        log(f"  {key:14s} rms rel err {e['rms_rel_err'] * 100:6.2f} %   max {e['max_rel_err'] * 100:6.2f} %   ({e['points']} points)")


def report_memory(profile: Profile, log: Callable[[str], None] = print) -> None:
    """One line: the memory coefficients, with the rms relative error of each measured one's fit."""
    m, fits = profile.memory, profile.fit.get("memory", {}).get("fits", {})
    how = f"measured, {m.basis} basis" if m.derive == "measured" else f"not measured: derive {m.derive or 'none'}"

    def coeff(key: str) -> str:
        err = f" ({fits[key]['rms_rel_err'] * 100:.2f} % rms)" if key in fits else ""
        return f"{key} {getattr(m, key):,.1f} B{err}"

    log(f"  memory ({how}): {coeff('act_token')}, {coeff('ckpt_token')}, {coeff('logits_token')} per token; "
        f"bwd_workspace {m.bwd_workspace:.3f} layers, kv_grad {m.kv_grad:g}")


# --- which profile this run plans on -------------------------------------------------------------------------------

def run_device_type() -> str:
    """Where ``pretrain_gpt.py`` runs: ``cuda`` where a GPU is visible, else ``cpu`` (as ``initialize`` chooses)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Target:
    """What the profile is for: the run's device type (``cuda``/``cpu``) and dtype, and on CUDA the key's GPU name,
    attention kernel and torch version, and the torch device the start-up profiler measures on (tests measure "a
    GPU" on the CPU)."""

    device_type: str
    dtype: torch.dtype
    gpu: str = ""
    kernel: str = ""
    measure_on: torch.device = torch.device("cpu")
    torch_version: str = torch.__version__

    @classmethod
    def of_run(cls, cfg: TrainingConfig, device: torch.device) -> "Target":
        """This run's: its device, its dtype (``--bf16``, ``--fp16``, else fp32) and the kernel the executor will run
        there (``--attention-backend``, else ``EPP_ATTENTION_BACKEND``; with or without GQA and attention dropout)."""
        dtype = params_dtype(cfg)
        if device.type != "cuda":
            return cls(device.type, dtype)
        gqa = (cfg.model.kv_heads or cfg.model.num_attention_heads) != cfg.model.num_attention_heads
        kernel = kernels.select_backend(kernels.requested_backend(cfg.model.attention_backend), device, dtype,
                                        dropout=cfg.model.attention_dropout, gqa=gqa)
        return cls("cuda", dtype, torch.cuda.get_device_name(device), kernel, device)

    def key(self, shape: ModelShape, seq_length: int) -> ProfileKey:
        return ProfileKey.of(self.gpu, str(self.dtype).removeprefix("torch."), self.kernel, shape, self.torch_version, seq_length)


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
               f"GPU, not a TP {cfg.parallel.dims.tp} shard: the analytic profile of the model instead (scripts/profile_gpu.py "
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
                                   name=f"{target.gpu} ({str(target.dtype).removeprefix('torch.')}, {target.kernel})",
                                   budget_s=STARTUP_BUDGET_S, rotary_base=cfg.model.rotary_base, log=log,
                                   note="measured at start-up by pretrain_gpt.py --epp-profile auto", seq_length=cfg.model.seq_length)
    finally:
        rng_tracker.set_states(tracker_states)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


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
    return Resolved(profile, resolved.origin + (f"; {note}" if note else ""), resolved.key)


def describe(cfg: TrainingConfig, resolved: Resolved) -> str:
    """The start-up line: ``--epp-profile SPEC: measured|analytic on DEVICE (model NAME; where from[; key KEY])``."""
    p = resolved.profile
    key = f"; key {resolved.key}" if resolved.key else ""
    return f"--epp-profile {cfg.epp.planner.profile}: {p.source} on {p.device} (model {p.model.name}; {resolved.origin}{key})"


def check_profile(cfg: TrainingConfig) -> None:
    """Before any work: a profile that is loaded (not measured on this GPU) loads and suits this device and TP."""
    if not (cfg.epp.planner.profile == AUTO_PROFILE and run_device_type() == "cuda"):
        resolve_profile(cfg, Target(run_device_type(), params_dtype(cfg)))


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


def planner_profile(cfg: TrainingConfig) -> Profile:
    """The profile the planner plans on before :func:`startup_profile` resolved the run's (the memory-budget check
    before start-up), at the run's TP size: ``auto`` on CUDA takes the analytic profile of the model (its memory
    Megatron's count; the profile measured at start-up has the allocator's, and the budget is checked again on it),
    and any other ``--epp-profile`` loads as it will."""
    if cfg.epp.planner.profile == AUTO_PROFILE and run_device_type() == "cuda":
        return analytic_profile(model_shape(cfg), cfg.parallel.dims.tp)
    return resolve_profile(cfg, Target(run_device_type(), params_dtype(cfg))).profile
