#!/usr/bin/env python3
"""Per-chunk-and-stage executor overhead: the elastic schedule against the same layers run bare.

    torchrun --nproc-per-node 2 -m benchmarks.profile_executor [--chunks 48 --tokens 64 --steps 8] [--cprofile FILE]

Builds this repository's elastic GPT stage (pp = the number of ranks, test-model shape by default:
4 layers, hidden 64, 4 heads) and runs a plan of ``--chunks`` equal chunks of ``--tokens`` tokens
(``--kind batched``: one whole sequence per chunk; ``split``: one sequence cut in ``--chunks``
slices, each attending to its prefix K/V) through ``forward_backward_elastic``, then the same
chunks through the stage's layers alone (``bare``: the model's own forward and ``backward`` of a
random output gradient, no schedule, no p2p, no Megatron ``forward_step``). With equal chunks a
1F1B step takes ``(K + P - 1) * (f + b + o)``, so the overhead per chunk and stage is::

    o = step / (K + P - 1) - bare per chunk (the slowest stage)

Both are medians over ``--steps`` (after one warm-up). The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist


from megatron_epp.executor import batches as _batches
from megatron_epp.executor.batches import chunk_batches, elastic_gpt_forward_step
from megatron_epp.executor.context import ChunkContext
from megatron_epp.executor.schedule import forward_backward_elastic
from megatron_epp.executor.spec import elastic_layer_spec, install_chunk_context
from megatron_epp.plan import Chunk, Pipeline, Plan, Segment, chunk_kind
from megatron_epp.config.parser import parse_config
from megatron_epp.model.runtime import initialize, shutdown
from megatron_epp.training.loop import build_optimizer
from megatron_epp.model.gpt import build_model, default_layer_spec
from benchmarks.common import Parser


prepare_step = getattr(_batches, "prepare_step", None)
PREPARED = prepare_step is not None


def equal_plan(kind: str, chunks: int, tokens: int, stages: int, layers: int) -> Plan:
    """``chunks`` chunks of ``tokens`` tokens: whole sequences (``batched``) or slices of one sequence (``split``)."""
    if kind == "batched":
        lengths = [tokens] * chunks
        segments = [[Segment(i, 0, tokens)] for i in range(chunks)]
    else:
        lengths = [tokens * chunks]
        segments = [[Segment(0, i * tokens, (i + 1) * tokens)] for i in range(chunks)]
    pipe = Pipeline([Chunk(i, chunk_kind(s, lengths), s) for i, s in enumerate(segments)], [[0] * chunks for _ in range(stages)])
    return Plan(lengths, stages, [layers // stages] * stages, [pipe], builder=f"equal-{kind}").validate()


def main(argv: list[str] | None = None) -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=48)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--kind", choices=["batched", "split"], default="batched")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cprofile", default=None, help="write the cProfile stats of the elastic steps on --cprofile-rank here")
    p.add_argument("--cprofile-rank", type=int, default=0)
    ours, flags = p.parse_known_args(argv)
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    defaults = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                str(ours.tokens * ours.chunks), "--max-position-embeddings", str(ours.tokens * ours.chunks),
                "--micro-batch-size", "1", "--global-batch-size", "1", "--vocab-size", "256",
                "--pipeline-model-parallel-size", str(world), "--position-embedding-type", "rope", "--mock-data"]
    args = parse_config(defaults + flags, world_size=world)
    runtime = initialize(args)
    context = ChunkContext()
    if "context" in inspect.signature(build_model).parameters:
        model, config = build_model(args, runtime, context=context)
    else:  # a tree from before build_model took the context (the "before" of docs/measurements/2026-11-23-cpu/HISTORY.md)
        model, config = build_model(args, runtime, layer_spec=elastic_layer_spec(default_layer_spec(), context))
        install_chunk_context(model.module, context)
    build_optimizer(args, model, config)
    plan = equal_plan(ours.kind, ours.chunks, ours.tokens, runtime.dims.pp, args.model.num_layers)
    rng = np.random.default_rng(0)
    sequences = []
    for n in plan.seq_lengths:
        doc = torch.from_numpy(rng.integers(0, args.model.vocab_size, n + 1))
        sequences.append((doc[:-1], doc[1:]))

    def elastic_step() -> float:
        """One step as the training driver runs it: inputs prepared ahead (outside the timed span)."""
        inputs = prepare_step(plan, runtime.pp_rank, sequences, runtime.device) if PREPARED else None
        model.zero_grad_buffer()
        dist.barrier()
        t0 = time.perf_counter()
        if inputs is not None:
            forward_backward_elastic(forward_step_func=elastic_gpt_forward_step, data_iterator=iter(inputs.batches),
                                     model=[model], num_microbatches=ours.chunks, plan=plan, views=inputs.views)
        else:  # a tree without prepare_step (the "before" of docs/measurements/2026-11-23-cpu/HISTORY.md)
            forward_backward_elastic(forward_step_func=elastic_gpt_forward_step, data_iterator=chunk_batches(plan, sequences, runtime.device),
                                     model=[model], num_microbatches=ours.chunks, plan=plan)
        return (time.perf_counter() - t0) * 1000

    profiler = cProfile.Profile() if ours.cprofile and runtime.rank == ours.cprofile_rank else None
    elastic_step()
    times = []
    for _ in range(ours.steps):
        if profiler:
            profiler.enable()
        times.append(elastic_step())
        if profiler:
            profiler.disable()
    if profiler:
        profiler.dump_stats(ours.cprofile)

    # The same chunks through this stage's layers only: no schedule, no p2p, no forward_step.
    from megatron_epp.executor.context import ChunkView

    module = model.module
    pipe = plan.pipelines[0]
    layouts = [ChunkView.build(c, plan.seq_lengths, runtime.device) for c in pipe.chunks]
    batches = list(chunk_batches(plan, sequences, runtime.device))

    def bare_step() -> float:
        model.zero_grad_buffer()
        t0 = time.perf_counter()
        outputs = []
        for layout, batch in zip(layouts, batches):
            with context.running(layout):
                if not runtime.is_first_stage:
                    module.set_input_tensor(torch.randn(layout.chunk.num_tokens, 1, args.model.hidden_size, requires_grad=True))
                out = module(batch["tokens"], layout.position_ids[None], None, labels=batch["labels"] if runtime.is_last_stage else None)
                outputs.append(out)
        for layout, out in reversed(list(zip(layouts, outputs))):
            with context.running(layout):
                (out.sum() if runtime.is_last_stage else out).backward(None if runtime.is_last_stage else torch.ones_like(out))
        context.clear()
        return (time.perf_counter() - t0) * 1000

    bare_step()
    bare = [bare_step() for _ in range(ours.steps)]
    step_ms = statistics.median(times)
    bare_ms = statistics.median(bare) / ours.chunks
    slowest: list = [None] * runtime.world_size
    dist.all_gather_object(slowest, bare_ms)
    per_chunk = step_ms / (ours.chunks + runtime.dims.pp - 1)
    result = {"prepared_inputs": PREPARED, "kind": ours.kind, "chunks": ours.chunks, "tokens": ours.tokens, "stages": runtime.dims.pp,
              "step_ms": round(step_ms, 2), "bare_chunk_stage_ms": [round(x, 3) for x in slowest],
              "overhead_chunk_stage_ms": round(per_chunk - max(slowest), 3),
              "step_ms_all": [round(t, 1) for t in times]}
    if runtime.rank == 0:
        print(json.dumps(result), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
