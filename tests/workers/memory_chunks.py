"""Planner's predicted peak activation memory vs the tracker's measurement on real chunks (one process).

    python tests/workers/memory_chunks.py OUT.json [--model-dtype float32|bfloat16] [pretrain_gpt model flags...] [:: OUT2.json ...]
    torchrun --nproc-per-node 2 tests/workers/memory_chunks.py OUT.json --tensor-model-parallel-size 2 --sequence-parallel ...
    torchrun --nproc-per-node 2 tests/workers/memory_chunks.py OUT.json --context-parallel-size 2 ...

Several models separated by ``::`` are measured in one process (one start; each on its own model-parallel groups).

One stage (pp = 1: embedding, layers and output head) of the model the flags describe, cast to
``--model-dtype`` (the planner's shape gets the same dtype; training's ``--bf16`` is not used), the
executor's own layers (``ChunkRecomputeLayer`` + ``ElasticAttention``); each case is a small plan
(batched, split, hybrid chunks; sequences in 2 to 4 slices; no, partial and full recompute) run through
``forward_backward_elastic`` under :class:`ActivationMemoryTracker`, beside
``OnlinePlanner.predicted_activation_bytes`` of the same plan; also with the split sequences' K/V gradient
accumulators counted (the tracker's ``peak_with_kv_grads``, the planner with ``kv_grad`` 1: what CUDA's allocator
sees; ``pred_grads_seen``: the walk's peak over the moments the CPU tracker samples, when tensors are saved: the
forwards' ends and the recomputes, not the start of a backward, where a middle slice holds the accumulators beside
everything its forward left).
Writes ``[{case, rc, pred, meas, pred_grads, pred_grads_seen, meas_grads}]`` (rank 0's, under torchrun: a
tensor-parallel stage, its chunks padded under sequence parallelism; or a context-parallel one,
``--context-parallel-size``, each rank holding its block of every padded chunk, with every CP rank's peaks in
``meas_cp`` and ``meas_grads_cp``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MASTER_PORT", str(21000 + os.getpid() % 20000))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from megatron.core import parallel_state as ps, tensor_parallel  # noqa: E402

from megatron_epp.cost.features import chunk_features  # noqa: E402
from megatron_epp.cost.model import CostModel  # noqa: E402
from megatron_epp.simulator.memory import peak_host_memory, stage_memory  # noqa: E402
from megatron_epp.executor.schedule import forward_backward_elastic  # noqa: E402
from megatron_epp.executor.batches import chunk_batches, elastic_gpt_forward_step  # noqa: E402
from megatron_epp.executor.context import ChunkContext, token_multiple  # noqa: E402
from megatron_epp.executor.memory_tracker import ActivationMemoryTracker  # noqa: E402
from megatron_epp.plan import Chunk, Pipeline, Plan, Segment, chunk_kind  # noqa: E402
from megatron_epp.config.parser import parse_config  # noqa: E402
from megatron_epp.training.planning import online_planner  # noqa: E402
from megatron_epp.model.runtime import initialize  # noqa: E402
from megatron_epp.model.gpt import build_model  # noqa: E402
from tests.workers.runs import split_runs  # noqa: E402

S = Segment
# name -> chunks (segment lists); recompute counts: "none", "full" or a list per chunk ("L" = all layers)
CASES = [
    ("batched", [[S(0, 0, 200), S(1, 0, 90)]], ["none", "full"]),
    ("split", [[S(0, 0, 96)], [S(0, 96, 192)], [S(0, 192, 300)]], ["none", ["L", 1, 0], "full"]),
    ("split+hybrid+batched", [[S(0, 0, 150)], [S(0, 150, 300), S(1, 0, 60)], [S(2, 0, 100), S(3, 0, 50)]], ["none", [1, 0, "L"], "full"]),
    # a split sequence's K/V buffer holds all its tokens from its first slice's forward to that slice's
    # backward: a peak before the last slice's forward (here at the middle slice's, the batched chunk
    # still resident) counts it whole; a long first slice recomputed peaks in its own backward,
    # holding the buffers of its checkpointed layers
    ("batched-then-split", [[S(0, 0, 250)], [S(1, 0, 30)], [S(1, 30, 60)], [S(1, 60, 90)]], ["none", [0, 0, 1, 0], "full"]),
    ("long-first-slice", [[S(0, 0, 250)], [S(0, 250, 262)], [S(0, 262, 274)]], ["none", ["L", 0, 0], [1, 0, 0], "full"]),
    ("batched+split4+hybrid", [[S(0, 0, 40), S(1, 0, 30)], [S(2, 0, 100)], [S(2, 100, 170)], [S(2, 170, 220)], [S(2, 220, 260), S(3, 0, 50)]],
     ["none", [0, "L", 1, 0, 1], "full"]),
    ("two-split-sequences", [[S(0, 0, 80)], [S(0, 80, 160)], [S(1, 0, 60)], [S(1, 60, 120), S(2, 0, 30)]], ["none", [1, 0, 0, 1], "full"]),
    # chunks of odd token counts (padded under sequence parallelism at tp 2): a packed chunk, a first slice
    # alone (its padding segment makes it keep its own K/V), a hybrid tail
    ("odd-chunks", [[S(0, 0, 77), S(1, 0, 30)], [S(2, 0, 51)], [S(2, 51, 100), S(3, 0, 20)]], ["none", [1, 0, "L"], "full"]),
]


# activation offload (--offload): name -> chunks, [(recompute counts, offloaded checkpoints)] per chunk ("L": all layers)
OFFLOAD_CASES = [
    ("batched", [[S(0, 0, 200), S(1, 0, 90)]], [(["L"], ["L"]), (["L"], [1]), ([3], [2]), ([1], [1])]),
    ("split", [[S(0, 0, 96)], [S(0, 96, 192)], [S(0, 192, 300)]], [(["L", 1, 0], ["L", 1, 0]), (["L", "L", "L"], [2, 0, 1])]),
    ("split+hybrid+batched", [[S(0, 0, 150)], [S(0, 150, 300), S(1, 0, 60)], [S(2, 0, 100), S(3, 0, 50)]],
     [([2, 1, "L"], [2, 0, 3]), (["L", "L", "L"], ["L", "L", "L"])]),
    ("long-first-slice", [[S(0, 0, 250)], [S(0, 250, 262)], [S(0, 262, 274)]], [(["L", 0, 0], ["L", 0, 0]), ([3, 2, 0], [1, 2, 0])]),
]


# K/V buffers on the host (--kv-host): name -> chunks, [(recompute counts, offloaded checkpoints or None, kv_host)]
KV_HOST_CASES = [
    ("split", [[S(0, 0, 96)], [S(0, 96, 192)], [S(0, 192, 300)]], [("none", None, [0]), (["L", 1, 0], None, [0]),
                                                                     (["L", "L", "L"], [2, 0, 1], [0])]),
    ("split+hybrid+batched", [[S(0, 0, 150)], [S(0, 150, 300), S(1, 0, 60)], [S(2, 0, 100), S(3, 0, 50)]],
     [("none", None, [0]), ([2, 1, "L"], [2, 0, 3], [0])]),
    ("long-first-slice", [[S(0, 0, 250)], [S(0, 250, 262)], [S(0, 262, 274)]], [(["L", 0, 0], None, [0]), ([3, 2, 0], [1, 2, 0], [0])]),
    ("batched+split4+hybrid", [[S(0, 0, 40), S(1, 0, 30)], [S(2, 0, 100)], [S(2, 100, 170)], [S(2, 170, 220)], [S(2, 220, 260), S(3, 0, 50)]],
     [("none", None, [2]), ([0, "L", 1, 0, 1], None, [2])]),
    ("two-split-sequences", [[S(0, 0, 80)], [S(0, 80, 160)], [S(1, 0, 60)], [S(1, 60, 120), S(2, 0, 30)]],
     [("none", None, [1]), ([1, 0, 0, 1], None, [0, 1]), ("full", ["L", "L", 1, 0], [0, 1])]),
]


def make_plan(chunks: list[list[Segment]], rc, layers: int, offload=None, kv_host=None) -> Plan:
    ends: dict[int, int] = {}
    for c in chunks:
        for s in c:
            ends[s.seq] = max(ends.get(s.seq, 0), s.end)
    lengths = [ends[i] for i in range(len(ends))]
    counts = {"none": [0] * len(chunks), "full": [layers] * len(chunks)}.get(rc) if isinstance(rc, str) else [layers if r == "L" else r for r in rc]
    pipe = Pipeline([Chunk(i, chunk_kind(c, lengths), c) for i, c in enumerate(chunks)], [counts])
    if offload is not None:
        pipe.offload = [[layers if o == "L" else o for o in offload]]
    if kv_host is not None:
        pipe.kv_host = list(kv_host)
    return Plan(lengths, 1, [layers], [pipe], builder="test").validate()


def peak_the_tracker_sees(cost_model: CostModel, plan: Plan) -> float:
    """The walk's peak (one stage) over the rows the CPU tracker samples (it sees memory when a tensor is
    saved): the ends of forwards and the recomputes, not a backward's start, nor a backward without recompute."""
    pipe = plan.pipelines[0]
    rc = np.asarray(pipe.recompute[0], dtype=float)
    sm = stage_memory(pipe, 0, 1, cost_model.costs(chunk_features(pipe.chunks)), int(cost_model.layers[0]), 0.0)
    rows = sm.rows(rc)
    kind = np.array([op.kind for op in sm.ops])[sm.row_op]
    recomputes = np.array([rc[op.pos] > 0 for op in sm.ops])[sm.row_op]
    first_of_op = np.concatenate([[True], sm.row_op[1:] != sm.row_op[:-1]])
    seen = (kind == "F") | (recomputes & ~first_of_op)
    return float(rows[seen].max())


def measure(argv: list[str]) -> None:
    """One model: ``OUT.json [--model-dtype ...] [pretrain_gpt model flags...]``."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--offload", action="store_true", help="the OFFLOAD_CASES (measure_offload) instead of the CASES")
    p.add_argument("--offload-fault", default=None, help="with --offload: one of executor.offload.FAULTS")
    p.add_argument("--kv-host", action="store_true", help="the KV_HOST_CASES (measure_kv_host) instead of the CASES")
    ours, flags = p.parse_known_args(argv)
    args = parse_config(flags + ["--elastic-pp", "--mock-data", "--seq-length", "512", "--epp-memory-budget", "1"],
                      world_size=int(os.environ.get("WORLD_SIZE", "1")))
    runtime = initialize(args)
    context = ChunkContext()
    model, config = build_model(args, runtime, context=context)
    model.to(getattr(torch, ours.model_dtype))
    build = online_planner(args)
    cm = build.cost_model
    if cm.profile.model.dtype != ours.model_dtype:  # the shape OnlinePlanner takes from the flags has no cast's dtype
        shape = dataclasses.replace(cm.profile.model, dtype=ours.model_dtype)
        build.cost_model = CostModel(dataclasses.replace(cm.profile, model=shape), cm.num_stages, cm.layers, dp=cm.dp)
    # the same planner counting the K/V gradient accumulators (set after the model is built: the CPU profile's
    # memory derivation, applied by CostModel, counts saved tensors alone)
    with_kv_grads = copy.copy(build)
    with_kv_grads.cost_model = copy.copy(build.cost_model)
    memory = dataclasses.replace(build.cost_model.profile.memory, kv_grad=1.0)
    with_kv_grads.cost_model.profile = dataclasses.replace(build.cost_model.profile, memory=memory)
    gen = torch.Generator().manual_seed(0)
    if ours.offload:
        return measure_offload(ours, args, runtime, context, model, config, build, gen)
    if ours.kv_host:
        return measure_kv_host(ours, args, runtime, context, model, config, (build, with_kv_grads), gen)
    results = []
    for name, chunks, rcs in CASES:
        for rc in rcs:
            plan = make_plan(chunks, rc, args.model.num_layers)
            docs = [torch.randint(0, args.model.vocab_size, (n + 1,), generator=gen) for n in plan.seq_lengths]
            tracker, _ = run_plan(plan, docs, runtime, context, model, config)
            pred = build.predicted_activation_bytes(plan)[0]
            pred_grads = with_kv_grads.predicted_activation_bytes(plan)[0]
            results.append({"case": name, "rc": plan.pipelines[0].recompute[0], "pred": pred, "meas": tracker.peak_bytes,
                            "pred_grads": pred_grads, "pred_grads_seen": peak_the_tracker_sees(with_kv_grads.cost_model, plan),
                            "meas_grads": tracker.peak_with_kv_grads})
    if ps.get_context_parallel_world_size() > 1:  # every CP rank's peaks (each holds its own block of every chunk)
        peaks = [None] * ps.get_context_parallel_world_size()
        torch.distributed.all_gather_object(peaks, [(r["meas"], r["meas_grads"]) for r in results],
                                            group=ps.get_context_parallel_group())
        for i, r in enumerate(results):
            r["meas_cp"], r["meas_grads_cp"] = ([rank[i][k] for rank in peaks] for k in (0, 1))
    if runtime.rank == 0:
        with open(ours.out, "w") as f:
            json.dump(results, f)


def run_plan(plan: Plan, docs, runtime, context: ChunkContext, model, config) -> tuple[ActivationMemoryTracker, dict]:
    """One step of ``plan`` under the tracker; the tracker and the gradients (by parameter name, cloned). The random
    states are seeded first: with dropout, every run of the same plan draws the same masks."""
    model.zero_grad_buffer()
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    with ActivationMemoryTracker(torch.device("cpu"), context) as tracker:
        forward_backward_elastic(
            forward_step_func=elastic_gpt_forward_step,
            data_iterator=chunk_batches(plan, [(d[:-1], d[1:]) for d in docs], runtime.device, token_multiple(config),
                                        ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
            model=[model], num_microbatches=len(plan.pipelines[0].chunks), plan=plan,
        )
    return tracker, {n: q.main_grad.detach().clone() for n, q in model.named_parameters()}


def measure_offload(ours, args, runtime, context: ChunkContext, model, config, build, gen) -> None:
    """``--offload``: every OFFLOAD_CASES plan with and without its offload: ``[{case, rc, offload, pred, meas,
    pred_host, meas_host, bitwise}]`` (``bitwise``: the gradients with offload equal those without, bit for bit)."""
    context.offloader(runtime.device).fault = ours.offload_fault
    layers = args.model.num_layers
    results = []
    for name, chunks, pairs in OFFLOAD_CASES:
        for rc, off in pairs:
            plan = make_plan(chunks, rc, layers, off)
            plain = make_plan(chunks, rc, layers)
            docs = [torch.randint(0, args.model.vocab_size, (n + 1,), generator=gen) for n in plan.seq_lengths]
            _, want = run_plan(plain, docs, runtime, context, model, config)
            tracker, got = run_plan(plan, docs, runtime, context, model, config)
            cm = build.cost_model
            pipe = plan.pipelines[0]
            pred_host = peak_host_memory(pipe, cm.costs(chunk_features(pipe.chunks)), cm.layers)[0]
            results.append({"case": name, "rc": pipe.recompute[0], "offload": pipe.offload[0],
                            "pred": build.predicted_activation_bytes(plan)[0], "meas": tracker.peak_bytes,
                            "pred_host": float(pred_host), "meas_host": tracker.peak_host_bytes,
                            "bitwise": all(torch.equal(want[n], got[n]) for n in want)})
    model.zero_grad_buffer()
    if runtime.rank == 0:
        with open(ours.out, "w") as f:
            json.dump(results, f)


def measure_kv_host(ours, args, runtime, context: ChunkContext, model, config, builds, gen) -> None:
    """``--kv-host``: every KV_HOST_CASES plan with and without its K/V buffers on the host (and its offload):
    ``[{case, rc, offload, kv_host, pred, meas, pred_grads, meas_grads, pred_host, meas_host, pred_host_grads,
    meas_host_grads, meas_device_kv, bitwise}]``: device peaks (the walk's, and with the K/V gradient accumulators counted, ``kv_grad``
    1, against the tracker's with them; ``meas_device_kv``: the same plan's with its K/V on the device), host peaks
    (the pool's, and with its accumulators), and the gradients with
    the K/V on the host equal those without, bit for bit."""
    build, with_kv_grads = builds
    layers = args.model.num_layers
    results = []
    for name, chunks, triples in KV_HOST_CASES:
        for rc, off, host in triples:
            plan = make_plan(chunks, rc, layers, off, host)
            plain = make_plan(chunks, rc, layers)
            docs = [torch.randint(0, args.model.vocab_size, (n + 1,), generator=gen) for n in plan.seq_lengths]
            device, want = run_plan(plain, docs, runtime, context, model, config)
            tracker, got = run_plan(plan, docs, runtime, context, model, config)
            pipe = plan.pipelines[0]
            host_peaks = [peak_host_memory(pipe, b.cost_model.costs(chunk_features(pipe.chunks)), b.cost_model.layers)[0]
                          for b in (build, with_kv_grads)]
            results.append({"case": name, "rc": pipe.recompute[0], "offload": pipe.offloaded(0), "kv_host": pipe.kv_host,
                            "pred": build.predicted_activation_bytes(plan)[0], "meas": tracker.peak_bytes,
                            "pred_grads": with_kv_grads.predicted_activation_bytes(plan)[0], "meas_grads": tracker.peak_with_kv_grads,
                            "pred_host": float(host_peaks[0]), "meas_host": tracker.peak_host_bytes,
                            "pred_host_grads": float(host_peaks[1]), "meas_host_grads": tracker.peak_host_with_grads,
                            "meas_device_kv": device.peak_bytes, "bitwise": all(torch.equal(want[n], got[n]) for n in want)})
    model.zero_grad_buffer()
    if runtime.rank == 0:
        with open(ours.out, "w") as f:
            json.dump(results, f)


def main() -> None:
    for i, argv in enumerate(split_runs(sys.argv[1:])):
        if i:
            ps.destroy_model_parallel()  # the process group stays: the next model's initialize builds new groups on it
        measure(argv)


if __name__ == "__main__":
    main()
