"""How ``pretrain_gpt.py --elastic-pp`` plans: its flags turned once into the planner's settings, model shape,
parallel dims and profile (:func:`online_planner`), the whole-document sampler split by the planner's modelled work
(:func:`elastic_sampler`), the start-up check that the memory budget can plan (:func:`check_memory_budget`), and
``--epp-offload``'s host link with the copy bandwidth measured at start-up (:func:`startup_host_link`)."""

from __future__ import annotations

import functools

from megatron_epp.data.blend import blended_documents
from megatron_epp.data.mock_documents import MockDocuments, lognormal_lengths
from megatron_epp.data.sequence_sampler import SequenceSampler
from megatron_epp.plan import PlanInfeasible
from megatron_epp.planner.data_parallel import dp_split
from megatron_epp.planner.online import OnlinePlanner
from megatron_epp.base.units import GIB
from megatron_epp.cost.host import HOST_MEMORY_SHARE, HostLink, measured_host_link
from megatron_epp.cost.profile import Profile
from megatron_epp.config.errors import ArgumentError
from megatron_epp.config.fields import TrainingConfig
from megatron_epp.model.gpt import model_shape
from megatron_epp.measure.host_bandwidth import measure_node_copy_bandwidth
from megatron_epp.measure.profile_resolution import planner_profile


def online_planner(cfg: TrainingConfig, profile: Profile | None = None, host: HostLink | None = None) -> OnlinePlanner:
    """The run's online planner (``--epp-*``), for its model and pipeline on ``profile``, the one the run resolved at
    start-up (:func:`~megatron_epp.measure.profile_resolution.startup_profile`; before it, :func:`planner_profile`'s),
    calibrated every ``--epp-calibrate-interval`` steps; ``--epp-offload`` plans on ``host``, the host link measured at
    start-up (:func:`startup_host_link`; before it, the assumed one of ``cost.host.local_host_link``)."""
    return OnlinePlanner(cfg.epp.planner, model_shape(cfg), cfg.parallel.dims,
                         profile or planner_profile(cfg), distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                         calibrate_interval=cfg.epp.calibrate_interval, host=host)


def startup_host_link(cfg: TrainingConfig, device, local_ranks: int) -> tuple[HostLink, str] | None:
    """``--epp-offload`` (not ``none``): this node's host link with the copy bandwidth measured now (every rank calls
    it at once: :func:`~megatron_epp.measure.host_bandwidth.measure_node_copy_bandwidth`, the minimum over the ranks)
    and its start-up line; None without offload (nothing measured)."""
    if cfg.epp.planner.offload == "none":
        return None
    measured = measure_node_copy_bandwidth(device)
    link = measured_host_link(measured.d2h_bytes_per_ms, measured.h2d_bytes_per_ms, local_ranks)
    given = cfg.epp.planner.host_memory_budget_bytes
    budget = (f"{given / GIB:.1f} GB per rank (--epp-host-memory-budget)" if given is not None else
              f"{link.default_budget_bytes() / GIB:.1f} GB per rank ({HOST_MEMORY_SHARE:.0%} of it over the local ranks)")
    how = ("both directions at once" if measured.device_type == "cuda"
           else "host to host into the CPU executor's pool and back, one after the other")
    out, back = ("device->host", "host->device") if measured.device_type == "cuda" else ("out", "back")
    line = (f"host link: measured {link.d2h_gbps:.1f} GB/s {out}, {link.h2d_gbps:.1f} {back} ({how}, {local_ranks} local "
            f"rank{'' if local_ranks == 1 else 's'}; median of {measured.repeats} x {measured.nbytes / 2**20:g} MiB, the "
            f"minimum over {measured.ranks} rank{'' if measured.ranks == 1 else 's'}), host memory "
            f"{link.host_memory_gb:.1f} GB, budget {budget}")
    return link, line


def elastic_sampler(cfg: TrainingConfig, split: str, dp_size: int, planner: OnlinePlanner):
    """The whole-document sampler of ``split`` ('train'/'valid') for ``dp_size`` replicas, split by
    the planner's modelled work (``planner``'s cost model), or None if the split is empty."""
    documents = elastic_documents(cfg, split)
    if documents is None:
        return None
    # the work vector of the model as built, never a calibrated one: every rank must split the batch the
    # same way, and each replica calibrates its own planner
    by_work = functools.partial(dp_split, work_vector=planner.raw_model.work_vector())
    return SequenceSampler(documents, cfg.training.global_batch_size, cfg.model.seq_length, seed=cfg.training.seed,
                           dp_size=dp_size, dp_split=by_work, truncate=cfg.epp.truncate_documents)


def check_memory_budget(cfg: TrainingConfig, planner: OnlinePlanner | None = None) -> str:
    """Fail before any work if no plan fits the budget for documents of the full context length; else the
    start-up line's account of the budget: how it was found (given, or :mod:`.memory_budget`'s default), the
    model states the planner counts in it (the largest stage's) and what it leaves for activations. ``planner``:
    the run's (:func:`online_planner`), on the profile resolved at start-up (a profile measured on the GPU, whose
    memory may exceed the analytic count the check before start-up used) or, before it, on
    :func:`~megatron_epp.measure.profile_resolution.planner_profile`'s (None: one built on that)."""
    docs = max(cfg.training.global_batch_size // cfg.parallel.dims.dp, 1)
    planner = planner or online_planner(cfg)
    try:
        planner([cfg.model.seq_length] * docs)
    except PlanInfeasible as error:
        raise ArgumentError(
            f"--epp-memory-budget {cfg.epp.planner.memory_budget_bytes / GIB} GB: {docs} documents of --seq-length "
            f"{cfg.model.seq_length} tokens per replica cannot be planned ({error})"
        ) from None
    default = cfg.epp.default_budget
    states = float(planner.raw_model.model_state_bytes().max())
    return (f"{planner.config.memory_budget_bytes / GIB:.2f} GB per device"
            + (f" = {default.describe()}" if default is not None else " (--epp-memory-budget)")
            + f"; model states {states / GIB:.2f} GB (the cost model's count, largest stage), "
            f"{(planner.config.memory_budget_bytes - states) / GIB:.2f} GB for activations")


def elastic_documents(cfg: TrainingConfig, split: str):
    """Whole documents: skewed mock lengths (capped at the context length) or the split of the indexed
    dataset(s) of ``--data-path`` (blended by weight; with ``--sft``, with their loss masks)."""
    if cfg.data.mock_data:
        seed = cfg.training.seed + (split == "valid")
        lengths = lognormal_lengths(4096, median=max(cfg.model.seq_length // 8, 2), sigma=1.2, max_length=cfg.model.seq_length + 1, seed=seed)
        return MockDocuments(lengths, cfg.model.vocab_size, seed=seed)
    return blended_documents(cfg.data.data_blend, cfg.data.split, split, loss_masks=cfg.data.sft)
