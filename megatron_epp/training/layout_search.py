"""``pretrain_gpt.py --epp-search-layout``: the best parallel layout for this run, printed as flags.

The model is the one the flags describe (:func:`~megatron_epp.training.model.model_shape`: SwiGLU, RMSNorm, GQA,
biases, the padded vocabulary, bf16 with ``--bf16``, as the driver builds it), the
lengths a global batch of the train split's documents (``--data-path``, or the mock documents),
capped at ``--seq-length``, the cluster the ``--epp-cluster`` preset resized to the world size, the
planner's settings the ``--epp-*`` flags given (the budget: ``--epp-memory-budget``, else the preset's
GPU memory). Only layouts the driver runs (TP x PP x DP) are searched; ``epp-plan --epp-search-layout``
also weighs Ulysses SP stages (simulated only).
"""

from __future__ import annotations

import argparse

import numpy as np

from megatron_epp.cost.clusters import get_cluster
from megatron_epp.plan import PlanInfeasible
from megatron_epp.planner.config import DEFAULT_CLUSTER, PlannerConfig
from megatron_epp.planner.layout import describe_choice, search_for_world
from megatron_epp.planner.lengths import select_batch
from megatron_epp.training.arguments import ArgumentError
from megatron_epp.training.elastic import elastic_documents
from megatron_epp.training.model import model_shape


def driver_layout_search(args: argparse.Namespace, world_size: int) -> list[str]:
    """The report lines; the last is the best layout's flags. Raises :class:`ArgumentError`."""
    shape = model_shape(args)
    cluster = args.epp_cluster or DEFAULT_CLUSTER
    docs = elastic_documents(args, "train")
    sequences = np.asarray(docs.lengths, dtype=np.int64) - 1  # a document of n tokens trains n - 1 positions
    batch = select_batch(sequences[sequences > 0], args.global_batch_size, args.seed, args.seq_length, truncate=True)
    try:
        config = PlannerConfig(
            memory_gb=args.epp_memory_budget or get_cluster(cluster).memory_gb, max_seq_len=args.seq_length,
            recompute=args.epp_recompute or "adaptive", max_slices=args.epp_max_slices, time_limit=args.epp_time_limit or 0.1,
        )
        choice, sized = search_for_world(batch, shape, cluster, world_size, config, runnable_only=True)
    except (PlanInfeasible, ValueError) as error:
        raise ArgumentError(f"--epp-search-layout: {error}") from None
    return describe_choice(choice, sized)
