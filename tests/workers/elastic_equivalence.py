"""Random elastic plans vs a non-pipelined reference, many cases in one process-group launch.

    torchrun ... tests/workers/elastic_equivalence.py OUT --mode reference|elastic --cases N
        [--fault drop_prefix|drop_prefix_grads|misplaced_kv|leak_packing|forward_order_backward|recompute_without_rng_restore|gqa_tiled_heads
                 |cp_all_to_all_order|cp_rope_of_another_rank|cp_loss_not_summed
                 |chunked_loss_skip_block|tiled_mlp_skip_block]
        [--sp-fault-cases K] [--offload [--offload-fault wrong-slot|skip-reload]] [--kv-host [--kv-host-fault kv-wrong-rows|kv-skip-write|kv-skip-accumulate]] [--attention-backend auto|sdpa|fa4|flash|varlen] [--varlen-reference enable_gqa|expanded]
        [pretrain_gpt flags...] [:: OUT --mode ... (another run)]...

``reference`` (one process): stock Megatron-Core (local spec, no EPP), each whole sequence its own
micro-batch. ``elastic``: a random valid plan per case (per data-parallel rank) through
``forward_backward_elastic``. Both save loss and gradients by global parameter name per case.
Faults in what the layers see of a chunk come from a broken chunk context given to the model.
``--sp-fault-cases K`` (with ``--sequence-parallel``): after the N cases, the first K again under each of
``SP_FAULTS`` in the same launch (saved as ``FAULT_case...``). Each case also saves the padding tokens its
plan's chunks got on this rank (``padding``), and in elastic runs the plan (``plan``, JSON) and the transfers the
schedule made (``transfers``: :class:`RecordingCommunicator`'s calls).

Several runs separated by ``::`` share the launch (one process start; the same world size): each builds its own
model-parallel groups, model and optimizer, and tears the groups down for the next; a fault patched into a module
(``inject``) is undone after its run. ``--attention-backend`` sets ``EPP_ATTENTION_BACKEND`` for one run's model.
``--varlen-reference`` puts the tests' reference ``varlen_attn`` (``benchmarks/attention_harness.py``: CPU fp32, torch
2.13's signature or 2.11's without ``enable_gqa``) in place of torch's for one run: with ``--attention-backend
varlen`` the model's attention runs the real ``torch-varlen`` path (packing, ``cu_seqlens``, GQA) on CPU.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from typing import Callable

import numpy as np
import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.utils import get_model_config

from megatron_epp.executor import attention, chunked_loss, kernels, recompute_layer, tiled_mlp
from megatron_epp.executor.schedule import forward_backward_elastic
from megatron_epp.executor.batches import chunk_batches, elastic_gpt_forward_step
from megatron_epp.executor.context import ChunkContext, ChunkView, KVBuffer, padding_tokens, token_multiple
from megatron_epp.plan import order as schedule_order
from megatron_epp.config.parser import parse_config
from megatron_epp.training.gpt_step import gpt_forward_step, reduce_losses
from megatron_epp.model.runtime import Runtime, initialize, shutdown
from megatron_epp.training.loop import build_optimizer
from megatron_epp.model.gpt import build_model
from megatron.core.utils import unwrap_model
from benchmarks.attention_harness import reference_torch_varlen
from tests.workers.grad_dump import global_name, set_global_weights
from tests.workers.runs import split_runs
from tests.workers.random_plans import random_lengths, random_plan


class DropPrefix(ChunkContext):
    """Slices attend without the K/V of their sequence's earlier slices (each as a whole sequence)."""

    def running(self, layout: ChunkView):
        return super().running(layout if layout.split_index is None else dataclasses.replace(layout, split_index=None, context=0))


class _PrefixGradsDropped(KVBuffer):
    def gradients(self, start, grad_key, grad_value):
        return grad_key[start:], grad_value[start:]


class _MisplacedWrite(KVBuffer):
    def write(self, start, key, value):
        super().write(start, key.roll(1, 0), value.roll(1, 0))


class BrokenBuffers(ChunkContext):
    """K/V buffers of class ``BUFFER``: put in the context before the first slice asks for them."""

    BUFFER: type[KVBuffer]

    def kv_buffer(self, seq, layer, length, like):
        if (seq, layer) not in self.kv:
            self.kv[seq, layer] = self.BUFFER(length, like)
        return super().kv_buffer(seq, layer, length, like)


class DropPrefixGrads(BrokenBuffers):
    """The gradients later slices compute for the K/V of earlier slices never reach them."""

    BUFFER = _PrefixGradsDropped


class MisplacedKV(BrokenBuffers):
    """Each slice's K/V land one row off in its buffer (rolled within the slice's rows)."""

    BUFFER = _MisplacedWrite


class LeakPacking(ChunkContext):
    """Whole sequences packed in one chunk attend across each other (one causal block)."""

    def running(self, layout: ChunkView):
        return super().running(layout if layout.split_index is not None else dataclasses.replace(layout, bounds=[(0, layout.num_tokens)]))


class RopeOfAnotherRank(ChunkContext):
    """Context parallelism: RoPE rotates each rank's tokens by the positions of the next rank's block."""

    def running(self, layout: ChunkView):
        start, end = layout.local_range
        shift = (end - start) % layout.num_tokens if layout.cp_size > 1 else 0
        layout.__dict__["local_position_ids"] = layout.position_ids.roll(-shift)[start:end]  # the cached property's slot
        return super().running(layout)


BROKEN_CONTEXTS = {
    "drop_prefix": DropPrefix, "drop_prefix_grads": DropPrefixGrads, "misplaced_kv": MisplacedKV, "leak_packing": LeakPacking,
    "cp_rope_of_another_rank": RopeOfAnotherRank,
}


def _tokens(tensors) -> int | None:
    """The token count of what a send is given (None: nothing, or a loss at the last stage)."""
    tensor = tensors[0] if isinstance(tensors, list) else tensors
    return tensor.shape[0] if tensor is not None and tensor.dim() else None


class RecordingCommunicator(P2PCommunicator):
    """Megatron-Core's communicator that records each call the schedule makes: ``(method, tokens sent or received,
    ...)``; a call at a pipeline end that moves nothing is recorded too (the op lists have none)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple] = []

    def recv_forward(self, tensor_shapes, is_first_stage):
        self.calls.append(("recv_forward", tensor_shapes[0][0]))
        return super().recv_forward(tensor_shapes, is_first_stage)

    def recv_backward(self, tensor_shapes, is_last_stage):
        self.calls.append(("recv_backward", tensor_shapes[0][0]))
        return super().recv_backward(tensor_shapes, is_last_stage)

    def send_forward(self, output_tensors, is_last_stage):
        self.calls.append(("send_forward", _tokens(output_tensors)))
        return super().send_forward(output_tensors, is_last_stage)

    def send_backward(self, input_tensor_grads, is_first_stage):
        self.calls.append(("send_backward", _tokens(input_tensor_grads)))
        return super().send_backward(input_tensor_grads, is_first_stage)

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage):
        self.calls.append(("send_forward_recv_backward", _tokens(output_tensors), tensor_shapes[0][0]))
        return super().send_forward_recv_backward(output_tensors, tensor_shapes, is_last_stage)

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage):
        self.calls.append(("send_backward_recv_forward", _tokens(input_tensor_grads), tensor_shapes[0][0]))
        return super().send_backward_recv_forward(input_tensor_grads, tensor_shapes, is_first_stage)


def _patch(module, name: str, value) -> Callable[[], None]:
    """Set ``module.name`` to ``value``; returns what puts the original back."""
    original = getattr(module, name)
    setattr(module, name, value)
    return lambda: setattr(module, name, original)


def inject(fault: str) -> Callable[[], None]:
    """Break one mechanism of the schedule or the recompute on purpose (the comparison must then fail); returns
    the undo, for the next run of the launch."""
    if fault == "recompute_without_rng_restore":
        def checkpoint(fn, _distribute, *args):
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)

        return _patch(recompute_layer, "tensor_parallel", type("TP", (), {"checkpoint": staticmethod(checkpoint)}))
    if fault == "forward_order_backward":
        return _patch(schedule_order, "backward_order", lambda pipe: list(range(len(pipe.chunks))))
    if fault == "gqa_tiled_heads":
        attend = kernels.segment_attention

        def tiled(q, k, v, *rest, **kwargs):  # K/V heads tiled (0 1 0 1), not shared by consecutive query heads (0 0 1 1)
            repeat = q.shape[2] // k.shape[2]
            return attend(q, k.repeat(1, 1, repeat, 1), v.repeat(1, 1, repeat, 1), *rest, **kwargs)

        return _patch(kernels, "segment_attention", tiled)
    if fault == "cp_all_to_all_order":
        gather = attention.tokens_to_heads

        def reversed_blocks(t, group):  # the ranks' token blocks gathered last rank first
            out = gather(t, group)
            return out.reshape(group.size(), -1, *out.shape[1:]).flip(0).reshape(out.shape)

        return _patch(attention, "tokens_to_heads", reversed_blocks)
    if fault == "tiled_mlp_skip_block":  # the tiled MLP's backward drops every block's gradients but the first's
        block_grads = tiled_mlp._block_grads
        return _patch(tiled_mlp, "_block_grads", lambda first, *rest: tuple(
            None if g is None else g * (first == 0) for g in block_grads(first, *rest)))
    if fault == "chunked_loss_skip_block":  # the chunked head's backward drops every block's gradient but the first's
        block_grad = chunked_loss._block_grad
        return _patch(chunked_loss, "_block_grad", lambda first, *rest: block_grad(first, *rest) * (first == 0))
    raise ValueError(fault)


def inject_before_model(fault: str | None, runtime: Runtime) -> Runtime:
    """Faults in the process groups of the runtime's ProcessGroupCollection (so set before the model is built): the
    runtime to run with. ``cp_loss_not_summed``: the data-parallel group with context parallelism is the one without
    it, so neither the gradients (DDP) nor the token count (the schedule's ``finalize_model_grads``) nor the reported
    loss are summed over the CP ranks."""
    if fault != "cp_loss_not_summed":
        return runtime
    groups = copy.copy(runtime.pg_collection)
    groups.dp_cp = groups.dp
    return dataclasses.replace(runtime, pg_collection=groups)

# sequence parallelism, checked in the launch of the good cases: the norms' gradients not summed over the
# tensor-parallel ranks (their sequence_parallel tag dropped); the padding tokens counted in the loss
SP_FAULTS = ("sp_norm_grads_not_reduced", "sp_padding_in_loss")


def untag_sequence_parallel_norms(gpt: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Drop the ``sequence_parallel`` tag of the norms' parameters (``finalize_model_grads`` then leaves each rank
    with the gradient of its own tokens only); returns them, to tag again."""
    params = [q for n, q in gpt.named_parameters() if "layernorm" in n and getattr(q, "sequence_parallel", False)]
    for q in params:
        q.sequence_parallel = False
    return params


def padding_in_loss(batches):
    """Every token of every chunk counted in the loss, the padding too."""
    for batch in batches:
        yield {**batch, "loss_mask": torch.ones_like(batch["loss_mask"])} if batch else batch


def case_sequences(case: int, seed: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng([seed, case])
    out = []
    for n in random_lengths(rng):
        doc = torch.from_numpy(rng.integers(0, vocab, n + 1))
        out.append((doc[:-1], doc[1:]))
    return out


def random_offload(plan, rng: np.random.Generator) -> None:
    """Offloaded checkpoints per (stage, chunk): all its checkpointed layers' for half, a random share for the rest."""
    for pipe in plan.pipelines:
        rc = np.asarray(pipe.recompute)
        share = rng.integers(0, rc + 1)
        pipe.offload = np.where(rng.random(rc.shape) < 0.5, rc, share).tolist()
    plan.validate()


def random_kv_host(plan, rng: np.random.Generator) -> None:
    """K/V buffers on the host: every split sequence of a pipeline for half the pipelines, a random share for the rest."""
    for pipe in plan.pipelines:
        split = sorted({s.seq for c in pipe.chunks for s in c.segments if s.length != plan.seq_lengths[s.seq]})
        pipe.kv_host = split if rng.random() < 0.5 else [q for q in split if rng.random() < 0.5]
    plan.validate()


def run(argv: list[str]) -> None:
    """One run: ``OUT --mode ... [pretrain_gpt flags]`` on the process group already started (or starting it)."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--mode", choices=["reference", "elastic"], required=True)
    p.add_argument("--cases", type=int, required=True)
    p.add_argument("--case-seed", type=int, default=0)
    p.add_argument("--fault", default=None)
    p.add_argument("--sp-fault-cases", type=int, default=0, help="the first K cases again under each of SP_FAULTS")
    p.add_argument("--random-recompute", action="store_true", help="random per (stage, chunk) recompute counts")
    p.add_argument("--offload", action="store_true", help="random offloaded checkpoints per (stage, chunk), <= its recompute "
                                                          "(half of them all of it): the plans otherwise as without")
    p.add_argument("--offload-fault", default=None, help="one of executor.offload.FAULTS (with --offload)")
    p.add_argument("--kv-host", action="store_true", help="random split sequences' K/V buffers on the host (the plans otherwise as without)")
    p.add_argument("--kv-host-fault", default=None, help="one of executor.kv_host.FAULTS (with --kv-host)")
    p.add_argument("--attention-backend", default=None, help="EPP_ATTENTION_BACKEND for this run's model")
    p.add_argument("--varlen-reference", choices=["enable_gqa", "aten-flash", "expanded"], default=None,
                   help="torch's varlen_attn replaced by the tests' reference for this run, in this GQA mode (its signature with "
                        "enable_gqa; without it, over the reference aten flash ops or with the K/V heads expanded)")
    ours, flags = p.parse_known_args(argv)
    backend_before = os.environ.get(kernels.ENV)
    if ours.attention_backend is not None:
        os.environ[kernels.ENV] = ours.attention_backend  # read when the attention is built
    undo_varlen = None
    if ours.varlen_reference is not None:
        reference = reference_torch_varlen(ours.varlen_reference)
        undo_varlen = _patch(kernels, "load_torch_varlen", lambda: (reference, ""))
    # a small vocabulary, padded alike at every tp (64 is a multiple of 32 x tp for tp <= 2): the reference
    # and the tensor-parallel runs are the same model; the test's flags come after and win
    args = parse_config(["--vocab-size", "64", "--make-vocab-size-divisible-by", "32", *flags])
    runtime = initialize(args)
    elastic = ours.mode == "elastic"
    context = BROKEN_CONTEXTS.get(ours.fault, ChunkContext)() if elastic else None
    runtime = inject_before_model(ours.fault, runtime)
    model, config = build_model(args, runtime, context=context)
    gpt = unwrap_model(model)  # through DDP (and Float16Module with --bf16): parameters by their own names
    if ours.offload_fault:
        context.offloader(runtime.device).fault = ours.offload_fault
    if ours.kv_host_fault:
        context.kv_host_store(runtime.device).fault = ours.kv_host_fault
    undo = inject(ours.fault) if ours.fault and ours.fault not in BROKEN_CONTEXTS and ours.fault != "cp_loss_not_summed" else None
    per_stage = args.model.num_layers // runtime.dims.pp
    set_global_weights(gpt, runtime.pp_rank, per_stage, runtime.tp_rank, args.parallel.dims.tp, args.model.swiglu)
    build_optimizer(args, model, config)
    runs = [(case, None) for case in range(ours.cases)]
    if ours.sp_fault_cases:
        if not args.parallel.dims.sequence_parallel:
            raise ValueError("--sp-fault-cases needs --sequence-parallel")
        runs += [(case, fault) for fault in SP_FAULTS for case in range(ours.sp_fault_cases)]
    for case, fault in runs:
        sequences = case_sequences(case, ours.case_seed, args.model.vocab_size)
        model.zero_grad_buffer()
        padding, record = 0, {}
        if elastic:
            mine = sequences[runtime.dp_rank :: runtime.dims.dp]
            plan = random_plan(np.random.default_rng([ours.case_seed, case, runtime.dp_rank, 7]), [len(t) for t, _ in mine], runtime.dims.pp, per_stage)
            if ours.random_recompute:
                rng = np.random.default_rng([ours.case_seed, case, runtime.dp_rank, 11])
                for pipe in plan.pipelines:
                    pipe.recompute = rng.integers(0, per_stage + 1, size=(runtime.dims.pp, len(pipe.chunks))).tolist()
            if ours.offload:
                random_offload(plan, np.random.default_rng([ours.case_seed, case, runtime.dp_rank, 13]))
            if ours.kv_host:
                random_kv_host(plan, np.random.default_rng([ours.case_seed, case, runtime.dp_rank, 17]))
            multiple = token_multiple(config)
            padding = sum(padding_tokens(c.num_tokens, multiple) for c in plan.chunks())
            batches = chunk_batches(plan, mine, runtime.device, multiple, runtime.cp_rank, runtime.dims.cp)
            untagged = untag_sequence_parallel_norms(gpt) if fault == "sp_norm_grads_not_reduced" else []
            comm = RecordingCommunicator(pp_group=runtime.pg_collection.pp, config=get_model_config(model))
            if context.offload is not None:
                context.offload.pool.reset_peak()
            losses = forward_backward_elastic(
                forward_step_func=elastic_gpt_forward_step,
                data_iterator=padding_in_loss(batches) if fault == "sp_padding_in_loss" else batches,
                model=[model], num_microbatches=sum(len(q.chunks) for q in plan.pipelines), plan=plan, p2p_communicator=comm,
                pg_collection=runtime.pg_collection,
            )
            record = {"plan": plan.to_json(), "transfers": comm.calls,
                      "host_peak": context.offload.pool.peak_bytes if context.offload is not None else 0}
            for q in untagged:
                q.sequence_parallel = True
        else:
            batches = iter(  # on the model's device (the stock forward step takes the batch as given)
                {k: v.to(runtime.device) for k, v in {"tokens": t[None], "labels": l[None], "loss_mask": torch.ones(1, len(t)),
                                                      "position_ids": torch.arange(len(t))[None]}.items()}
                for t, l in sequences
            )
            losses = get_forward_backward_func()(
                forward_step_func=gpt_forward_step, data_iterator=batches, model=[model],
                num_microbatches=len(sequences), seq_length=1, micro_batch_size=1,
            )
        loss = reduce_losses(losses, runtime.pg_collection.dp_cp)
        if runtime.dp_rank == 0 and runtime.tp_rank == 0 and runtime.cp_rank == 0:
            grads = {global_name(n, runtime.pp_rank, per_stage): q.main_grad.detach().cpu().clone() for n, q in gpt.named_parameters()}
            prefix = f"{fault}_" if fault else ""
            torch.save({"loss": loss, "grads": grads, "padding": padding, **record}, f"{ours.out}/{prefix}case{case}_stage{runtime.pp_rank}.pt")
    for undo_patch in (undo, undo_varlen):
        if undo_patch is not None:
            undo_patch()
    if backend_before is None:
        os.environ.pop(kernels.ENV, None)
    else:
        os.environ[kernels.ENV] = backend_before


def main() -> None:
    for i, argv in enumerate(split_runs(sys.argv[1:])):
        if i:
            ps.destroy_model_parallel()  # the process group stays: the next run's initialize builds new groups on it
        run(argv)
    shutdown()


if __name__ == "__main__":
    sys.exit(main())
