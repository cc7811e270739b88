"""``--elastic-pp``: whole documents per global batch, a new plan every step, the elastic schedule."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_epp.elastic_schedule import forward_backward_elastic
from megatron_epp.elastic_step import chunk_batches, elastic_gpt_forward_step
from megatron_epp.plan import Plan
from megatron_epp.training.arguments import ArgumentError
from megatron_epp.training.initialize import Runtime
from megatron_epp.training.loop import StepFunction

PlanBuilder = Callable[[list[int]], Plan]
CHECKPOINTING = {"adaptive": "ilp", "none": "none", "full": "full"}  # --epp-recompute -> planner mode
GIB = 1024**3


def plan_builder(args: argparse.Namespace) -> PlanBuilder:
    """The ``--epp-plan`` builder on the planner's cost model for this model and pipeline."""
    from megatron_epp.planner import baselines, builder
    from megatron_epp.planner.cost_model import CostModel
    from megatron_epp.planner.profiles import load_model

    profile = load_model(args.epp_profile, tp=args.tensor_model_parallel_size)
    shape = dataclasses.replace(
        profile.model, num_layers=args.num_layers, hidden=args.hidden_size, num_heads=args.num_attention_heads,
        ffn_hidden=args.ffn_hidden_size, vocab=args.vocab_size,
    )
    cost_model = CostModel(
        dataclasses.replace(profile, model=shape), args.pipeline_model_parallel_size, dp=args.data_parallel_size
    )
    memory_gb = args.epp_memory_budget

    def build(lengths: list[int]) -> Plan:
        if args.epp_plan == "megatron":
            return baselines.megatron_plan(lengths, cost_model, memory_gb, args.seq_length)
        if args.epp_plan == "seq1f1b":
            return baselines.seq1f1b_plan(lengths, cost_model, memory_gb, args.seq_length, k=args.epp_max_slices)
        return builder.build_plan(lengths, cost_model, memory_gb, checkpointing=CHECKPOINTING[args.epp_recompute],
                                  slice_counts=range(1, args.epp_max_slices + 1))

    return build


def _share_plan(plan: Plan | None) -> Plan:
    """Give every rank of this model replica (all stages, all tensor ranks) the plan of its first rank."""
    group = ps.get_model_parallel_group()
    box = [plan.to_json() if plan is not None else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return Plan.from_json(box[0])


class ElasticStep:
    """A :data:`StepFunction` over a sequence sampler: plan, broadcast, run; keeps the last summary."""

    def __init__(self, args: argparse.Namespace, runtime: Runtime, model, sampler, consumed: int, build: PlanBuilder) -> None:
        self.args, self.runtime, self.model, self.build = args, runtime, model, build
        self.batches = sampler.iterate(consumed)
        self.plans_here = ps.get_model_parallel_group().rank() == 0
        self.last_summary = ""

    def __call__(self, forward_only: bool) -> tuple[list[dict[str, torch.Tensor]], int]:
        batch = next(self.batches)
        sequences = batch.sequences(self.runtime.dp_rank)
        lengths = [len(s.tokens) for s in sequences]
        t0 = time.perf_counter()
        plan = _share_plan(self.build(lengths).validate() if self.plans_here else None)
        plan_ms = (time.perf_counter() - t0) * 1000
        tensors = [(torch.from_numpy(s.tokens), torch.from_numpy(s.labels)) for s in sequences]
        t1 = time.perf_counter()
        losses = forward_backward_elastic(
            forward_step_func=elastic_gpt_forward_step,
            data_iterator=chunk_batches(plan, tensors, self.runtime.device),
            model=[self.model],
            num_microbatches=sum(len(p.chunks) for p in plan.pipelines),
            forward_only=forward_only,
            plan=plan,
        )
        run_ms = (time.perf_counter() - t1) * 1000
        predicted = plan.info.get("predicted_step_ms")
        self.last_summary = (
            f"{plan.summary()} | planning ms: {plan_ms:.1f} | "
            + (f"predicted ms: {predicted:.1f} | " if predicted is not None else "")
            + f"measured ms: {run_ms:.1f}"
        )
        return losses, int(batch.seq_lengths.sum())


def elastic_step(args: argparse.Namespace, runtime: Runtime, model, split: str, consumed: int) -> ElasticStep | None:
    """The elastic step function for ``split`` ('train'/'valid'), or None if the split is empty."""
    from megatron_epp.data.sequence_sampler import SequenceSampler

    documents = elastic_documents(args, split)
    if documents is None:
        return None
    sampler = SequenceSampler(documents, args.global_batch_size, args.seq_length, seed=args.seed, dp_size=runtime.dp_size)
    return ElasticStep(args, runtime, model, sampler, consumed, plan_builder(args))


def check_memory_budget(args: argparse.Namespace) -> None:
    """Fail before any work if no plan fits the budget for documents of the full context length."""
    from megatron_epp.planner.builder import PlanInfeasible

    docs = max(args.global_batch_size // args.data_parallel_size, 1)
    try:
        plan_builder(args)([args.seq_length] * docs)
    except PlanInfeasible as error:
        raise ArgumentError(
            f"--epp-memory-budget {args.epp_memory_budget} GB: {docs} documents of --seq-length "
            f"{args.seq_length} tokens per replica cannot be planned ({error})"
        ) from None


def elastic_documents(args: argparse.Namespace, split: str):
    """Whole documents: skewed mock lengths (capped at the context length) or an indexed dataset split."""
    from megatron_epp.data.documents import DocumentDataset, split_ranges
    from megatron_epp.data.mock_documents import MockDocuments, lognormal_lengths

    if args.mock_data:
        seed = args.seed + (split == "valid")
        lengths = lognormal_lengths(4096, median=max(args.seq_length // 8, 2), sigma=1.2, max_length=args.seq_length + 1, seed=seed)
        return MockDocuments(lengths, args.vocab_size, seed=seed)
    docs = DocumentDataset(args.data_path)
    docs = DocumentDataset(args.data_path, split_ranges(len(docs), args.split)[split])
    return docs if len(docs) else None
