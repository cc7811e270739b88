"""How ``pretrain_gpt.py --elastic-pp`` plans: its flags turned once into the planner's settings, model shape,
parallel dims and profile (:func:`online_planner`), the whole-document sampler split by the planner's modelled work
(:func:`elastic_sampler`), and the start-up check that the memory budget can plan (:func:`check_memory_budget`)."""

from __future__ import annotations

import argparse
import functools

from megatron_epp.cost.profiles import GIB
from megatron_epp.data.blend import blended_documents
from megatron_epp.data.mock_documents import MockDocuments, lognormal_lengths
from megatron_epp.data.sequence_sampler import SequenceSampler
from megatron_epp.plan import PlanInfeasible
from megatron_epp.planner.config import ParallelDims, PlannerConfig
from megatron_epp.planner.data_parallel import split_data_parallel
from megatron_epp.planner.online import OnlinePlanner
from megatron_epp.training.arguments import ArgumentError
from megatron_epp.training.model import model_shape
from megatron_epp.training.profiling import planner_profile


def online_planner(args: argparse.Namespace) -> OnlinePlanner:
    """The run's online planner (``--epp-*``), for its model and pipeline on the profile it resolved (at its TP size;
    the start-up line says which), calibrated every ``--epp-calibrate-interval`` steps."""
    return OnlinePlanner(PlannerConfig.from_args(args, args.seq_length), model_shape(args), ParallelDims.from_args(args),
                         planner_profile(args), distributed_optimizer=args.use_distributed_optimizer,
                         calibrate_interval=args.epp_calibrate_interval)


def elastic_sampler(args: argparse.Namespace, split: str, dp_size: int, planner: OnlinePlanner):
    """The whole-document sampler of ``split`` ('train'/'valid') for ``dp_size`` replicas, split by
    the planner's modelled work (``planner``'s cost model), or None if the split is empty."""
    documents = elastic_documents(args, split)
    if documents is None:
        return None
    # the work vector of the model as built, never a calibrated one: every rank must split the batch the
    # same way, and each replica calibrates its own planner
    by_work = functools.partial(split_data_parallel, work_vector=planner.cost_model.work_vector())
    return SequenceSampler(documents, args.global_batch_size, args.seq_length, seed=args.seed,
                           dp_size=dp_size, split=by_work, truncate=args.epp_truncate_documents)


def check_memory_budget(args: argparse.Namespace) -> str:
    """Fail before any work if no plan fits the budget for documents of the full context length; else the
    start-up line's account of the budget: how it was found (given, or :mod:`.memory_budget`'s default), the
    model states the planner counts in it (the largest stage's) and what it leaves for activations."""
    docs = max(args.global_batch_size // args.data_parallel_size, 1)
    planner = online_planner(args)
    try:
        planner([args.seq_length] * docs)
    except PlanInfeasible as error:
        raise ArgumentError(
            f"--epp-memory-budget {args.epp_memory_budget} GB: {docs} documents of --seq-length "
            f"{args.seq_length} tokens per replica cannot be planned ({error})"
        ) from None
    default = getattr(args, "epp_default_budget", None)
    states = float(planner.raw_model.model_state_bytes().max())
    return (f"{planner.config.memory_budget_bytes / GIB:.2f} GB per device"
            + (f" = {default.describe()}" if default is not None else " (--epp-memory-budget)")
            + f"; model states {states / GIB:.2f} GB (the cost model's count, largest stage), "
            f"{(planner.config.memory_budget_bytes - states) / GIB:.2f} GB for activations")


def elastic_documents(args: argparse.Namespace, split: str):
    """Whole documents: skewed mock lengths (capped at the context length) or the split of the indexed
    dataset(s) of ``--data-path`` (blended by weight)."""
    if args.mock_data:
        seed = args.seed + (split == "valid")
        lengths = lognormal_lengths(4096, median=max(args.seq_length // 8, 2), sigma=1.2, max_length=args.seq_length + 1, seed=seed)
        return MockDocuments(lengths, args.vocab_size, seed=seed)
    return blended_documents(args.data_blend, args.split, split)
