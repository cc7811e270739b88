"""Elastic 1F1B: run a Plan's chunks of different sizes through Megatron-Core's pipeline stages.

The op list per stage comes from :mod:`megatron_epp.plan.order` (warm-up
``P - p - 1 + K_max - 1``, then one forward / one backward, then cool-down), its sends and receives
included (the lists the simulator walks); the stage runner only executes it. Compute and
communication reuse megatron-core's ``forward_step`` / ``backward_step`` and ``P2PCommunicator``;
each transfer carries the chunk's own shape ``[tokens, 1, hidden]`` (under sequence parallelism
``[tokens / tp, 1, hidden]``, the chunk padded to a multiple of tp: ``ChunkView.build``), known to
both sides from the plan, so no shape handshake is needed. Pipelines (sequence groups) run one after another with
gradient accumulation; gradients are reduced once per step (``finalize_model_grads``) and divided by
the global batch's token count, so the loss and gradients equal non-pipelined training.

Out of memory: a stage that runs out of device memory in a forward, a backward (its recomputes included) or a
transfer's receive buffer drops what it holds for the step (saved activations, K/V buffers, the allocator's
cache) and runs the rest of its ops as stand-ins: no compute, zeros of the planned shape sent where the op
would send, what it receives dropped. Every transfer the plan pairs still happens, so no rank of the pipeline
waits for one that never comes; the other stages compute on as planned. At the end every rank of the world
agrees (one all-reduce) whether any rank failed; if so, every rank raises :class:`StepOutOfMemory` before any
gradient is reduced, and the caller frees, re-plans and runs the batch again (the training driver's
``ElasticTrainStep``). The data-parallel gradient reduction therefore starts only after that agreement (never
inside the last backward, so a replica whose stage failed mid-backward cannot leave its peers in a half-issued
reduction): with ``--overlap-grad-reduce`` the last chunk's backward no longer overlaps it. Tensor parallelism:
a stage's tensor-parallel ranks allocate the same shapes in the same order, so they run out together; one that
failed alone inside a layer's collective would leave its peers waiting in it (not contained).
"""

from __future__ import annotations

import contextlib
import gc
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import backward_step, deallocate_output_tensor, forward_step
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config, get_model_type

from megatron_epp.executor import kernels
from megatron_epp.executor.context import ChunkContext, ChunkView, sequence_slices, token_multiple
from megatron_epp.plan import Pipeline, Plan
from megatron_epp.plan.order import Op, stage_ops


# the groups the step reads of its ProcessGroupCollection (finalize_model_grads's among them)
STEP_GROUPS = ("tp", "cp", "pp", "embd", "pos_embd", "dp_cp")


@dataclass(frozen=True)
class OpFailure:
    """Where this rank ran out of memory: its stage, the pipeline index, the chunk (its plan id, kind and tokens),
    the op (``forward``, ``backward``, ``recompute`` or ``transfer``), the error's message (on one line, at most 600
    characters) and the bytes it asked for (parsed from CUDA's message; None where it does not say)."""

    stage: int
    pipeline: int
    chunk: int
    chunk_kind: str
    tokens: int
    op: str
    message: str
    requested_bytes: int | None

    def describe(self) -> str:
        return f"the {self.op} of chunk {self.chunk} ({self.chunk_kind}, {self.tokens} tokens) of pipeline {self.pipeline}"


class StepOutOfMemory(RuntimeError):
    """Raised on every rank by :func:`forward_backward_elastic` when some rank of the world ran out of memory in the
    step; ``failure``: this rank's :class:`OpFailure` (None on the ranks that did not fail). No gradient was reduced;
    the model's gradient buffers hold a partial accumulation (zero them before running the batch again)."""

    def __init__(self, failure: OpFailure | None) -> None:
        super().__init__(failure.message if failure is not None else "another rank ran out of memory in this step")
        self.failure = failure


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = r"([0-9.]+) (B|KiB|MiB|GiB|TiB)"
# what CUDA's out-of-memory message says of the device and the caching allocator, in the order it says it
_ALLOCATOR_FIGURES = (("total capacity of " + _SIZE, "capacity"), ("of which " + _SIZE + " is free", "free"),
                      ("this process has " + _SIZE + " memory in use", "in use"), (_SIZE + " is allocated by PyTorch", "allocated"),
                      (_SIZE + " is reserved by PyTorch but unallocated", "reserved unallocated"))


def allocator_figures(message: str) -> str | None:
    """CUDA's out-of-memory message's figures in one phrase (``139.80 GiB capacity, 123.44 MiB free, 139.67 GiB in
    use, 134.20 GiB allocated, 2.10 GiB reserved unallocated``), None where it has none (a planted error)."""
    found = [f"{m.group(1)} {m.group(2)} {name}" for pattern, name in _ALLOCATOR_FIGURES if (m := re.search(pattern, message))]
    return ", ".join(found) or None


def requested_bytes(message: str) -> int | None:
    """The bytes an out-of-memory error says were asked for (``Tried to allocate 2.00 GiB``), else None."""
    match = re.search(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)", message)
    return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None


def _any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank of the world (one all-reduce; every rank calls it)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _grad_sync_control(config) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(disable, enable)`` of DDP's gradient reduction, as Megatron's schedules do it."""
    no_sync_func = config.no_sync_func or contextlib.nullcontext
    context: list[Any] = []

    def disable() -> None:
        if not context:
            context.append(no_sync_func())
            context[0].__enter__()

    def enable() -> None:
        if context:
            context.pop().__exit__(None, None, None)

    return disable, enable


def forward_backward_elastic(
    *,
    forward_step_func,
    data_iterator: Iterator | list,
    model,
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    plan: Plan,
    views: Sequence[Sequence[ChunkView]] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Megatron-Core's schedule signature plus ``plan``; ``num_microbatches`` must be its chunk count.

    ``data_iterator`` yields one item per chunk in forward order (pipeline by pipeline); the current
    chunk's view (positions, packing, prefix) is set on every stage around each of its forwards and
    backwards, in the model's chunk context (``ChunkContext.of(model)``). ``views``
    (``[pipeline][chunk]``, this stage's, e.g. ``prepare_step(...).views`` built ahead) or, if None,
    built here from the plan; under sequence parallelism every view's token count must be a multiple of the
    tensor-parallel size (``ChunkView.build(..., multiple=token_multiple(config))`` pads it). If the step
    raises, the context is left with no current chunk and no kept K/V.
    Returns the last stage's per-chunk loss dicts.
    """
    model = model[0] if isinstance(model, list) else model
    data_iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    chunks = sum(len(p.chunks) for p in plan.pipelines)
    if views is not None and [len(p) for p in views] != [len(p.chunks) for p in plan.pipelines]:
        raise ValueError("views do not match the plan's pipelines and chunks")
    if num_microbatches != chunks:
        raise ValueError(f"num_microbatches={num_microbatches} but the plan has {chunks} chunks")
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=list(STEP_GROUPS))
    pp_group = pg_collection.pp
    if any(p.kv_host for p in plan.pipelines):
        _check_kv_host(model)
    if plan.num_stages != pp_group.size():
        raise ValueError(f"plan is for {plan.num_stages} stages, the pipeline has {pp_group.size()}")
    config = get_model_config(model)
    multiple = token_multiple(config)
    if views is not None and any(view.num_tokens % multiple for pipe in views for view in pipe):
        raise ValueError(f"sequence/context parallelism splits every chunk over {multiple} ranks: build the "
                         f"views with multiple={multiple} (ChunkView.build pads each chunk)")
    comm = p2p_communicator or P2PCommunicator(pp_group=pp_group, config=config)
    context = ChunkContext.of(model)
    runner = _StageRunner(forward_step_func, data_iterator, model, context, config, comm, pg_collection.cp, plan, forward_only,
                          collect_non_loss_data)
    disable_sync, enable_sync = _grad_sync_control(config)
    disable_sync()  # the gradient reduction waits for the world's agreement that no rank ran out of memory
    try:
        with context.step():
            for index, pipe in enumerate(plan.pipelines):
                pipe_views = views[index] if views is not None else runner.build_views(pipe)
                runner.run(index, pipe, pipe_views)
            if _any_rank(runner.failure is not None, runner.device):
                context.clear()
                raise StepOutOfMemory(runner.failure)
    finally:
        enable_sync()
    if forward_only:
        context.clear()
    elif config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(
            [model], runner.total_tokens if config.calculate_per_token_loss else None, pg_collection=pg_collection
        )
    return runner.losses


def _check_kv_host(model) -> None:
    """A plan with K/V buffers on the host (``executor.kv_host``) runs without attention dropout, where the block
    attention over the device window has its kernel (CPU; CUDA in fp16/bf16 with torch's aten flash ops,
    ``kernels.block_kernel``); else one line."""
    if get_model_config(model).attention_dropout > 0:
        raise ValueError("the plan keeps K/V buffers on the host (kv_host): they run without attention dropout "
                         "(a slice's blocks are merged by their log-sum-exp)")
    parameter = next(model.parameters())
    problem = kernels.block_kernel_problem(parameter.device, parameter.dtype)
    if problem:
        raise ValueError(f"the plan keeps K/V buffers on the host (kv_host): the block attention over the device window "
                         f"cannot run on {parameter.device.type} ({problem})")


_NO_RANGE = contextlib.nullcontext()  # reusable: one object for every op while no profiler records


class _StageRunner:
    """Runs one stage's op sequence for each pipeline of the plan."""

    def __init__(self, forward_step_func, data_iterator, model, context: ChunkContext, config, comm: P2PCommunicator, cp_group,
                 plan: Plan, forward_only: bool, collect_non_loss_data: bool) -> None:
        self.forward_step_func, self.data_iterator, self.model, self.context, self.config = forward_step_func, data_iterator, model, context, config
        self.comm, self.plan, self.forward_only, self.collect = comm, plan, forward_only, collect_non_loss_data
        self.stage = comm.pp_group.rank()
        self.first, self.last = self.stage == 0, self.stage == plan.num_stages - 1
        self.model_type = get_model_type(model)
        self.device = next(model.parameters()).device
        self.total_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.losses: list[dict[str, torch.Tensor]] = []
        self.microbatch = 0
        self.num_chunks = sum(len(p.chunks) for p in plan.pipelines)
        self.multiple = token_multiple(config)  # sequence and context parallelism: each rank holds 1/multiple of a chunk's tokens
        self.cp_rank, self.cp_size = cp_group.rank(), cp_group.size()  # this rank's block of each chunk's tokens
        self.failure: OpFailure | None = None  # set when this rank runs out of memory: the rest of the step is stand-ins
        self.saved: dict[int, tuple[Any, Any]] = {}  # the current pipeline's forwards awaiting their backward

    def shape(self, views: Sequence[ChunkView], pos: int) -> list[tuple[int, int, int]]:
        return [(views[pos].num_tokens // self.multiple, 1, self.config.hidden_size)]

    def build_views(self, pipe: Pipeline) -> list[ChunkView]:
        slices, host = sequence_slices(pipe.chunks, self.plan.seq_lengths), set(pipe.kv_host)
        return [ChunkView.build(c, self.plan.seq_lengths, self.device, recompute=count, multiple=self.multiple,
                                  cp_rank=self.cp_rank, cp_size=self.cp_size, offload=off, slices=slices, kv_host=host)
                for c, count, off in zip(pipe.chunks, pipe.recompute[self.stage], pipe.offloaded(self.stage))]

    def run(self, index: int, pipe: Pipeline, views: Sequence[ChunkView]) -> None:
        """Pipeline ``index``'s op list on this stage, sends and receives included (:func:`stage_ops` with
        ``comms``); after an out-of-memory error (:meth:`_fail`), stand-ins."""
        ops = stage_ops(pipe, self.stage, self.plan.num_stages, comms=True, forward_only=self.forward_only)
        self.saved = {}
        received: dict[tuple[str, int], Any] = {}  # ("F" | "B", pos) -> a forward input / output gradient, awaiting its op
        results: dict[tuple[str, int], Any] = {}  # ("F" | "B", pos) -> a forward output / input gradient, awaiting its send
        sent = {(op.kind[-1], op.pos) for op in ops if op.kind.startswith("SEND")}  # the results this stage sends
        i = 0
        while i < len(ops):
            op = ops[i]
            if op.kind == "F":
                input_tensor = received.pop(("F", op.pos), [None])  # [None]: nothing received, as at a pipeline end
                output = self._guarded(index, op, views[op.pos], lambda: self._forward(input_tensor, op.pos))
                if output is not None and not self.forward_only and self.failure is None:
                    self.saved[op.pos] = (input_tensor, output)
                if ("F", op.pos) in sent:
                    results["F", op.pos] = output if output is not None else self._stand_in(views, op)
                else:  # the last stage: Megatron's 1F1B frees the output's data here as after a send
                    self._release(output)
            elif op.kind == "B":
                input_tensor, output = self.saved.pop(op.pos, (None, None))
                grad_output = received.pop(("B", op.pos), [None])
                grad = self._guarded(index, op, views[op.pos],
                                     lambda: backward_step(input_tensor, output, grad_output, self.model_type, self.config))
                del input_tensor, output, grad_output
                if ("B", op.pos) in sent:
                    results["B", op.pos] = grad if self.failure is None else self._stand_in(views, op)
            else:
                recv = ops[i + 1] if i + 1 < len(ops) and ops[i + 1].batched else None
                self._communicate(index, views, op, recv, results, received)
                i += 2 if recv is not None else 1
                continue
            i += 1

    def _communicate(self, index: int, views: Sequence[ChunkView], op: Op, recv: Op | None,
                     results: dict[tuple[str, int], Any], received: dict[tuple[str, int], Any]) -> None:
        """A send (with ``recv``, the receive batched with it: one exchange) or a receive of the op list."""
        direction = op.kind[-1]
        if op.kind.startswith("RECV"):
            receive = self.comm.recv_forward if direction == "F" else self.comm.recv_backward
            edge = self.first if direction == "F" else self.last
            received[direction, op.pos] = self._transfer(index, views[op.pos], lambda: receive(self.shape(views, op.pos), edge))
            return
        tensor = results.pop((direction, op.pos))
        if direction == "F":
            if recv is None:
                self._transfer(index, views[op.pos], lambda: self.comm.send_forward(tensor, self.last))
            else:
                received["B", recv.pos] = self._transfer(index, views[op.pos], lambda: self.comm.send_forward_recv_backward(
                    tensor, self.shape(views, recv.pos), self.last))
            self._release(tensor)
        elif recv is None:
            self._transfer(index, views[op.pos], lambda: self.comm.send_backward(tensor, self.first))
        else:
            received["F", recv.pos] = self._transfer(index, views[op.pos], lambda: self.comm.send_backward_recv_forward(
                tensor, self.shape(views, recv.pos), self.first))

    def _release(self, output) -> None:
        """Free a sent forward output's data (its graph stays for the backward), as Megatron's schedules do."""
        if output is not None and self.failure is None and not self.forward_only:
            deallocate_output_tensor(output[0], self.config.deallocate_pipeline_outputs)

    def _guarded(self, index: int, op: Op, view: ChunkView, compute: Callable[[], Any]) -> Any:
        """``compute()`` with ``view`` current; None once this rank has run out of memory (then or before)."""
        if self.failure is not None:
            return None
        try:
            with self._op_range(index, op, view), self.context.running(view):
                self.context.before_op(op.kind, view)
                return compute()
        except torch.OutOfMemoryError as error:
            what = {"F": "forward", "B": "recompute" if self.context.recomputing else "backward"}[op.kind]
            self.context.recomputing = False
            self._fail(index, view, what, error)
            return None

    def _transfer(self, index: int, view: ChunkView, communicate: Callable[[], Any]) -> Any:
        """A send/receive; out of memory for its receive buffer, the step fails here and the transfer is made again
        once this rank's step memory is released (the buffers are allocated before anything is posted)."""
        try:
            self.context.before_op("T", view)
            return communicate()
        except torch.OutOfMemoryError as error:
            if self.failure is None:
                self._fail(index, view, "transfer", error)
            return communicate()

    def _fail(self, index: int, view: ChunkView, op: str, error: BaseException) -> None:
        """Record the failure and release what this rank holds for the step."""
        message = " ".join(str(error).split())[:600] or type(error).__name__
        chunk = view.chunk
        self.failure = OpFailure(self.stage, index, chunk.id, chunk.kind, chunk.num_tokens, op, message, requested_bytes(str(error)))
        self.saved.clear()
        self.context.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _stand_in(self, views: Sequence[ChunkView], op: Op) -> torch.Tensor:
        """What a failed rank sends in place of an op's result: zeros of the planned transfer's shape."""
        return torch.zeros(self.shape(views, op.pos)[0], dtype=self.config.pipeline_dtype, device=self.device)

    def _op_range(self, pipeline: int, op: Op, view: ChunkView) -> contextlib.AbstractContextManager:
        """The op as a named range while a profiler records (torch.profiler's trace; an NVTX range under
        ``emit_nvtx``): ``epp F p0 c3 split 4096t stage 1`` (forward or backward, pipeline, chunk position, kind, the
        chunk's tokens, stage; a backward that recomputes layers adds ``recompute N``). Otherwise no range and no
        name: one check of the profiler's state, no host-device sync."""
        if not torch.autograd._profiler_enabled():
            return _NO_RANGE
        recompute = f" recompute {view.recompute}" if op.kind == "B" and view.recompute else ""
        return torch.profiler.record_function(f"epp {op.kind} p{pipeline} c{op.pos} {view.chunk.kind} "
                                              f"{view.chunk.num_tokens}t stage {self.stage}{recompute}")

    def _forward(self, input_tensor, pos: int):
        output, num_tokens = forward_step(
            self.forward_step_func, self.data_iterator, self.model, self.num_chunks, input_tensor,
            self.losses, self.config, cp_group_size=1, collect_non_loss_data=self.collect,
            is_first_microbatch=self.microbatch == 0, current_microbatch=self.microbatch, is_last_stage=self.last,
        )
        self.microbatch += 1
        self.total_tokens += num_tokens
        return output
