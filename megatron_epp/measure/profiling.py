"""Measuring a cost profile on the device: one layer of the run's shape and its output head, timed and their memory
measured over a small grid (:func:`measure_profile`), shared by the start-up profiler
(:mod:`megatron_epp.measure.profile_resolution`) and ``python -m megatron_epp.measure.profile_gpu``: the time of each grid point and
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
from typing import Callable, Sequence

import psutil
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_epp.cost.profile_fit import attention_fit, head_fit, layer_fit, measured_memory, measured_profile, with_chunk_cost
from megatron_epp.cost.profile import Profile
from megatron_epp.cost.shape import DTYPE_BYTES, ModelShape
from megatron_epp.executor import fused, kernels
from megatron_epp.executor.chunked_loss import chunked_linear_cross_entropy
from megatron_epp.executor.context import ChunkContext, ChunkView, KVBuffer
from megatron_epp.executor.memory_tracker import ActivationMemoryTracker
from megatron_epp.executor.rotary import ChunkRotaryEmbedding
from megatron_epp.executor.spec import elastic_layer_spec
from megatron_epp.plan import Chunk, Segment
from megatron_epp.config.fields import ROTARY_BASE
from megatron_epp.model.fused_layers import FusedNorm, fused_layer_spec, tiled_mlp_spec
from megatron_epp.model.gpt import TorchNorm, architecture_config, elastic_base_layer_spec

# the most of the device's free memory the output head's largest profile point may take (its logits and their
# gradient, :func:`head_bytes_per_token`): a 128K vocabulary at 64K tokens would need 32 GiB of fp32 logits alone
HEAD_MEMORY_SHARE = 0.5
MAX_POSITIONS = 32768  # RoPE's table in a LayerStack unless the caller asks for more (measure_profile: its longest layer)
CHUNK_SPLIT = 4  # the per-chunk constant: the same tokens as one chunk of this many documents and as this many chunks

Step = tuple[Callable[[], object], Callable[..., torch.Tensor], tuple]  # a chunk of Timer.sequence: prepare, run, inputs


class LayerStack(torch.nn.Module):
    """``num_layers`` transformer layers of the training spec with prefix attention, plus the output head.

    The layers are built through the training spec (``elastic_base_layer_spec()`` passed through
    ``elastic_layer_spec``): ``ChunkRecomputeLayer`` with ``ElasticAttention`` as core attention, RoPE (when the
    shape has it) through the chunk rotary embedding, all reading the stack's own :class:`ChunkContext`. A
    checkpointed forward recomputes as training does (the chunk view's recompute count, megatron-core's
    ``tensor_parallel.checkpoint``). The head is the last stage's as training builds it: the final norm, the
    column-parallel output layer and megatron-core's cross entropy, times a loss mask. RoPE's table holds ``max_positions``
    positions: a chunk past them is refused. ``fused``: the run's fused kernels (:mod:`megatron_epp.executor.fused`),
    built through the same spec (:func:`~megatron_epp.model.fused_layers.fused_layer_spec`), the head's norm and cross
    entropy included (default: none, today's modules). Needs megatron-core's
    model-parallel state with one tensor-parallel rank (a training process at TP = 1, or
    ``megatron_epp.measure.layer_bench.init_single_process``).

    :meth:`set_segments` makes a chunk current in the stack's own context until the next call, so a
    forward and its backward (recompute included) run on that chunk.
    """

    def __init__(self, shape: ModelShape, num_layers: int, seed: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, rotary_base: int = ROTARY_BASE, max_positions: int = MAX_POSITIONS,
                 fused_kernels: fused.FusedChoice = fused.UNFUSED) -> None:
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
                                  kv_channels=shape.kv_channels, bias=shape.bias, qkv_bias=shape.qkv_bias, qk_layernorm=shape.qk_norm),
            use_cpu_initialization=on_cpu,  # else RoPE's frequencies are made on the current GPU
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            gradient_accumulation_fusion=False,
        )
        self.context = ChunkContext()
        spec = tiled_mlp_spec(fused_layer_spec(elastic_layer_spec(elastic_base_layer_spec(shape.normalization, shape.qk_norm), self.context),
                                               fused_kernels), shape.mlp_chunk_tokens)
        self.fused_kernels = fused_kernels
        self.layers = torch.nn.ModuleList(build_module(spec, config=config, layer_number=i + 1) for i in range(num_layers))
        self.rotary = ChunkRotaryEmbedding(RotaryEmbedding(config.kv_channels, rotary_percent=1.0, rotary_base=rotary_base,
                                                           use_cpu_initialization=on_cpu), self.context, max_positions) if shape.rope else None
        norm = TorchNorm if fused_kernels.norm == "torch" or shape.normalization != "RMSNorm" else FusedNorm
        self.final_norm = norm(config, shape.hidden, eps=config.layernorm_epsilon, **({} if norm is TorchNorm else {"backend": fused_kernels.norm}))
        self.head = tensor_parallel.ColumnParallelLinear(shape.hidden, shape.vocab, config=config, init_method=config.init_method,
                                                         bias=False, gather_output=False)
        self.shape = shape
        self._recompute_view: ChunkView | None = None
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
        self.context.current = ChunkView.build(chunk, [c + s for s, c in zip(lengths, contexts)], self.device)
        self._recompute_view = dataclasses.replace(self.context.current, recompute=len(self.layers))
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
        with self.context.running(self._recompute_view if checkpoint else self.context.view()):
            rotary = self.rotary(x.shape[0]) if self.rotary is not None else None
            for layer in self.layers:
                x = layer(x, attention_mask=None, rotary_pos_emb=rotary)[0]
        return x

    def head_loss(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's head on hidden states ``[s, 1, h]``: final norm, output layer, megatron-core's vocab-parallel
        cross entropy (fp32 softmax) against label 0, summed under a loss mask of ones (as training's per-token loss);
        with the shape's ``loss_chunk_tokens`` the run's chunked head (:mod:`megatron_epp.executor.chunked_loss`)."""
        labels = torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device)
        if self.shape.loss_chunk_tokens:  # the run's chunked head (ChunkedLossGPTModel): the logits never whole
            losses = chunked_linear_cross_entropy(self.final_norm(x), self.head.weight, labels, self.shape.loss_chunk_tokens)
            return (losses.float().reshape(-1) * torch.ones(x.shape[0], dtype=torch.float32, device=x.device)).sum()
        logits, _ = self.head(self.final_norm(x))
        if self.fused_kernels.cross_entropy == "torch":
            losses = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
        else:
            losses = fused.kernel("cross_entropy", self.fused_kernels.cross_entropy)(logits, labels)
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

    def sequence(self, chunks: Sequence[Step]) -> tuple[float, float]:
        """Forward and backward ms summed over ``chunks`` run one after another as the executor runs them: each made
        current (``prepare``, counted in its forward: the executor's host work per chunk), its forward, then its
        backward. On a GPU CUDA events, one synchronisation before and one after, none per chunk."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        marks = []
        for prepare, run, inputs in chunks:
            marks.append(self._mark())
            prepare()
            out = run(*inputs)
            marks.append(self._mark())
            (out if out.dim() == 0 else out.float().sum()).backward()
            marks.append(self._mark())
        if cuda:
            torch.cuda.synchronize()
        return (sum(self._ms(marks[i], marks[i + 1]) for i in range(0, len(marks), 3)),
                sum(self._ms(marks[i + 1], marks[i + 2]) for i in range(0, len(marks), 3)))

    def split(self, one: Callable[[], list[Step]], many: Callable[[], list[Step]]) -> tuple[float, float]:
        """Median over repeats of what ``many``'s chunks take more than ``one``'s, forward and backward, the two timed
        back to back in each repeat (inputs made outside the timing)."""
        rows = []
        for i in range(self.warmup + self.repeats):
            f1, b1 = self.sequence(one())
            fk, bk = self.sequence(many())
            if i >= self.warmup:
                rows.append((fk - f1, bk - b1))
        return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


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
        view = ChunkView.build(Chunk(0, "split" if c else "batched", [Segment(0, c, c + s)]), [c + s], device)

        def make() -> tuple[torch.Tensor, ...]:
            # the queries; a slice's K/V rows as its buffer holds them: the prefix's c rows, then its own s
            return tuple(torch.randn(n, 1, h, d, device=device, dtype=dtype, requires_grad=True)
                         for n, h in ((s, heads), (c + s, kv_heads), (c + s, kv_heads)))

        def run(q, k_rows, v_rows) -> torch.Tensor:
            return run_kernel(q, k_rows[c:], v_rows[c:], view, (k_rows, v_rows) if c else None, 0.0, scale)

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


def _measure_chunk_cost(m: Measurement, stack: LayerStack, tokens: int, k: int = CHUNK_SPLIT) -> dict | None:
    """The per-chunk constant (ms) of one layer's and of the head's forward and backward, with the run's kernels:
    ``tokens`` as one chunk of ``k`` documents and as ``k`` chunks of one document each (the same tokens, the same
    attention area; each chunk made current as the executor makes it), the excess over ``k - 1``, at least 0
    (:meth:`Timer.split`). None where the time box is spent or it ran out of memory (``b1`` stays the fitted intercept)."""
    s = max(tokens // k, 1)
    what = f"chunk cost {k} x {s} tokens"
    if m.late(0, 0, what):
        return None
    h, dev, dt = stack.shape.hidden, stack.device, stack.dtype

    def layer(n: int) -> list[Step]:
        return [(functools.partial(stack.set_segments, [s] * (k // n), [0] * (k // n)), stack, _hidden(s * k // n, h, dev, dt))
                for _ in range(n)]

    def head(n: int) -> list[Step]:
        return [(lambda: None, stack.head_loss, _hidden(s * k // n, h, dev, dt)) for _ in range(n)]

    row = m.point(what, lambda: (*m.timer.split(lambda: layer(1), lambda: layer(k)), *m.timer.split(lambda: head(1), lambda: head(k))))
    if row is None:
        return None
    out = dict(zip(("fwd", "bwd", "head_fwd", "head_bwd"), (max(v / (k - 1), 0.0) for v in row)))
    m.log(f"  {what}: per chunk, layer fwd {out['fwd']:.3f} bwd {out['bwd']:.3f} ms, head fwd {out['head_fwd']:.3f} "
          f"bwd {out['head_bwd']:.3f} ms")
    return {"tokens": s * k, "chunks": k, **out}


def chunk_tokens(layer_lengths: Sequence[int]) -> int:
    """The tokens the per-chunk constant is measured on: the second-shortest of the layer lengths measured (a quarter
    of the context cap on the start-up grid: chunks of a sixteenth of it)."""
    return sorted(set(layer_lengths))[1]


def _hidden(s: int, hidden: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor]:
    return (torch.randn(s, 1, hidden, device=device, dtype=dtype, requires_grad=True),)


def measure_profile(shape: ModelShape, device: torch.device, dtype: torch.dtype, kernel: str, grid: ProfileGrid, *,
                    name: str | None = None, budget_s: float | None = None, rotary_base: int = ROTARY_BASE,
                    log: Callable[[str], None] = print, note: str = "", seq_length: int | None = None,
                    fused_kernels: fused.FusedChoice = fused.UNFUSED) -> Profile:
    """Time the attention kernel, one layer and the output head of ``shape`` on ``device`` in ``dtype`` over ``grid``,
    and their per-chunk constant ``b1`` (:func:`_measure_chunk_cost`, in ``fit["chunk_cost"]``; None past the time box:
    the fitted intercept), measure the memory the layer (plain and checkpointed) and the head keep (:class:`MemoryMeter`), fit the cost
    model and the memory per token (:mod:`megatron_epp.cost.profile_fit`) and return the measured profile: its
    fits' errors in ``fit["errors"]``, the memory's in ``fit["memory"]``, its memory block ``derive`` ``"measured"``.
    ``name``: its ``device`` (default :func:`device_name`). ``seq_length``: the context cap it is for (its key's;
    default the grid's longest layer). ``budget_s``: a time box; past it each part keeps only the points its fit
    needs (5 attention, 3 layer, 2 head points; the rest are listed in ``fit["skipped"]``). The head's lengths are
    bounded by the device's free memory (:func:`head_lengths_within`); a point that runs out of memory is left out
    (``fit["out_of_memory"]``), and a part left with too few points raises :class:`ProfileFailed`. Every point is
    logged as one line. ``fused_kernels``: the layer's and head's fused kernels (their tag joins ``kernel`` in the
    default name, so the profile's key says them)."""
    grid.check()
    # as the stack measures it: in ``dtype``, without dropout (a run's dropout masks are carried by the basis count)
    shape = dataclasses.replace(shape, dtype=str(dtype).removeprefix("torch."), hidden_dropout=0.0, attention_dropout=0.0)
    m, timings = Measurement(device, grid, budget_s, log), {}
    attention, timings["attention"] = _measure_attention(m, shape, device, dtype, kernel, grid)
    stack = LayerStack(shape, num_layers=1, device=device, dtype=dtype, rotary_base=rotary_base,
                       max_positions=max(grid.layer_lengths), fused_kernels=fused_kernels)
    layer, layer_memory, timings["layer"] = _measure_layer(m, stack, grid.layer_lengths, attention)
    head_lengths = head_lengths_within(grid.head_lengths, shape, free_memory(device), log)
    head, head_memory, timings["head"] = _measure_head(m, stack, head_lengths)
    chunk = _measure_chunk_cost(m, stack, chunk_tokens([r[0] for r in timings["layer"]]))
    del stack
    if chunk is not None:  # b1 measured: the layer's and the head's a2 refitted beside it
        layer = with_chunk_cost(layer, [r[0] for r in timings["layer"]], {"fwd": [r[1] for r in timings["layer"]],
                                "bwd": [r[2] for r in timings["layer"]]}, {k: chunk[k] for k in ("fwd", "bwd")})
        head = with_chunk_cost(head, [r[0] for r in timings["head"]], {"head_fwd": [r[1] for r in timings["head"]],
                               "head_bwd": [r[2] for r in timings["head"]]}, {k: chunk[k] for k in ("head_fwd", "head_bwd")})
    memory, memory_fit = measured_memory(shape, device.type, layer_memory, head_memory)
    errors = {k: v[1] for k, v in {**attention, **layer, **head}.items()}
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))
    info = {"errors": errors, "torch": torch.__version__, "kernel": kernel, "dtype": dtype_name,
            "seq_length": int(seq_length or max(grid.layer_lengths)),
            "grid": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(grid).items()},
            "seconds": round(time.perf_counter() - m.t_start, 2), "skipped": m.skipped, "out_of_memory": m.out_of_memory,
            "memory": memory_fit, "chunk_cost": chunk,
            "note": ("medians; CUDA events and the caching allocator on GPU, process CPU time and autograd's saved tensors on "
                     "CPU") + (f"; {note}" if note else "")}
    key_kernel = kernel_key(kernel, fused_kernels, shape.loss_chunk_tokens, shape.mlp_chunk_tokens)
    return measured_profile(shape, name or device_name(device, dtype, key_kernel), layer, head, memory, {**info, "timings": timings})


def kernel_key(kernel: str, fused_kernels: fused.FusedChoice, loss_chunk_tokens: int = 0, mlp_chunk_tokens: int = 0) -> str:
    """The kernel part of a profile's key: the attention kernel, and the fused kernels' tag where any is fused
    (``flash-varlen+fused:norm=liger;...``), the chunked head's block where it is chunked (``+chunked-ce=4096``:
    the head's time and memory are its own) and the tiled MLP's (``+tiled-mlp=8192``: so are a layer's); the
    attention kernel alone otherwise (keys of earlier profiles)."""
    tag = fused_kernels.tag()
    key = f"{kernel}+{tag}" if tag else kernel
    key = f"{key}+chunked-ce={loss_chunk_tokens}" if loss_chunk_tokens else key
    return f"{key}+tiled-mlp={mlp_chunk_tokens}" if mlp_chunk_tokens else key


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
