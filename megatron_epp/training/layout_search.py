"""``pretrain_gpt.py --epp-search-layout``: the best parallel layout for this run, printed as flags.

The model is the one the flags describe (:func:`~megatron_epp.model.gpt.model_shape`: SwiGLU, RMSNorm, GQA,
biases, the padded vocabulary, bf16 with ``--bf16``, as the driver builds it), the lengths a global batch of
the train split's documents (``--data-path``, or the mock documents), one longer than ``--seq-length`` an error
unless ``--epp-truncate-documents`` (as in ``--elastic-pp`` training), the cluster the ``--epp-cluster`` preset
resized to the world size, the planner's settings the ``--epp-*`` flags given, else the driver's defaults (the
budget: ``--epp-memory-budget``, else the preset's GPU memory; :func:`~megatron_epp.config.validation.validate_search_args`).
The layouts are TP x CP x PP x DP (context parallelism, Ulysses all-to-all, with ``--elastic-pp``), as
``epp-plan --epp-search-layout``'s; ``--epp-longest-document`` adds each planned layout's longest single document.
"""

from __future__ import annotations


import numpy as np

from megatron_epp.plan import PlanInfeasible
from megatron_epp.planner.layout import describe_choice, longest_documents, search_for_world
from megatron_epp.data.lengths import select_batch
from megatron_epp.config.errors import ArgumentError
from megatron_epp.training.planning import elastic_documents
from megatron_epp.model.gpt import model_shape
from megatron_epp.config.fields import TrainingConfig


def driver_layout_search(cfg: TrainingConfig, world_size: int) -> list[str]:
    """The report lines; the last is the best layout's flags. Raises :class:`ArgumentError`."""
    shape = model_shape(cfg)
    docs = elastic_documents(cfg, "train")
    sequences = np.asarray(docs.lengths, dtype=np.int64) - 1  # a document of n tokens trains n - 1 positions
    try:
        batch = select_batch(sequences[sequences > 0], cfg.training.global_batch_size, cfg.training.seed, cfg.model.seq_length, cfg.epp.truncate_documents)
    except ValueError as error:
        raise ArgumentError(f"--epp-search-layout: --seq-length {cfg.model.seq_length}: {error}; pass --epp-truncate-documents "
                            "to cut them") from None
    try:
        choice, sized = search_for_world(batch, shape, cfg.epp.cluster, world_size, cfg.epp.planner)
    except (PlanInfeasible, ValueError) as error:
        raise ArgumentError(f"--epp-search-layout: {error}") from None
    longest = longest_documents(choice, shape, sized, cfg.epp.planner) if cfg.epp.longest_document else None
    return describe_choice(choice, sized, longest)
