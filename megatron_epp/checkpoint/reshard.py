"""How a checkpoint meets a run at another parallel layout (:class:`Reshard`): which sizes changed, whether the
optimizer states' format reshards to them, where this rank's per-rank objects (RNG states, planner calibration) are
in the saved grid, and the start-up lines of such a resume (:func:`reshard_notes`). megatron-core's
dist_checkpointing reshards the model's and the optimizer's ShardedTensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

from megatron_epp.checkpoint.records import (
    DP_RESHARDABLE,
    LAYOUT_SIZES,
    OPTIMIZER_REPLICA_SIZES,
    PLANNER_KEY,
    REPLICA_SIZES,
    iteration_dir,
    layout_record,
    read_metadata,
)
from megatron_epp.config.fields import TrainingConfig
from megatron_epp.model.runtime import Runtime


@dataclass(frozen=True)
class Reshard:
    """How ``--load``'s checkpoint meets this run's layout: its layout record (:func:`layout_record`; a checkpoint
    saved before the optimizer format was recorded: ``dp_reshardable`` with the distributed optimizer) and the
    sizes of :data:`LAYOUT_SIZES` that differ, as ``{key: (saved, now)}`` (empty: the same layout)."""

    saved: dict[str, Any]
    changed: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, cfg: TrainingConfig, meta: dict[str, Any]) -> "Reshard":
        saved = dict(meta.get("layout", {}))
        if saved.get("use_distributed_optimizer") and saved.get("distrib_optim_sharding_type") is None:
            saved["distrib_optim_sharding_type"] = DP_RESHARDABLE
        now = layout_record(cfg)
        return cls(saved, {key: (saved.get(key, 1), now.get(key, 1)) for key, _, _ in LAYOUT_SIZES if saved.get(key, 1) != now.get(key, 1)})

    @property
    def stages_kept(self) -> bool:
        """Whether every pipeline stage is as saved (only replica sizes changed): the planner's calibration carries over."""
        return all(key in REPLICA_SIZES for key in self.changed)

    def describe(self, side: int, stages_only: bool = False) -> str:
        """The changed sizes (``stages_only``: but the replica sizes), as saved (``side`` 0) or now (1): ``pp 2, dp 1``."""
        return ", ".join(f"{dims} {self.changed[key][side]}" for key, dims, _ in LAYOUT_SIZES
                         if key in self.changed and not (stages_only and key in REPLICA_SIZES))

    def problem(self, cfg: TrainingConfig) -> str | None:
        """Why the optimizer states cannot load at this layout (loaded: not ``--no-load-optim``/``--finetune``), else None."""
        if cfg.checkpoint.no_load_optim or cfg.checkpoint.finetune:
            return None  # the model alone: its weights are replicated over the context-parallel ranks too
        saved_do = bool(self.saved.get("use_distributed_optimizer"))
        if saved_do != cfg.parallel.use_distributed_optimizer:
            return (f"saved with --use-distributed-optimizer {saved_do}, this run has {cfg.parallel.use_distributed_optimizer}: "
                    "the optimizer states do not convert between the two (--no-load-optim loads the model alone)")
        if saved_do and self.saved["distrib_optim_sharding_type"] == DP_RESHARDABLE \
                and not all(key in OPTIMIZER_REPLICA_SIZES for key in self.changed):
            return (f"saved with {self.describe(0)} and the distributed optimizer's states in megatron-core's dp_reshardable "
                    f"format, which reshards over the data- and context-parallel sizes only; this run has {self.describe(1)} (save with "
                    "--dist-ckpt-optim-fully-reshardable to change the other sizes, or --no-load-optim to load the model alone)")
        return None

    def saved_place(self, runtime: Runtime) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The saved per-rank objects' grid (the sizes the checkpoint recorded, in :data:`LAYOUT_SIZES`' order: a size added
        later is not in an older checkpoint's grid), and the place in it whose object this rank loads: its own rank in
        each size kept, its rank modulo the saved size in each size changed (a replica size: the saved replicas are alike)."""
        recorded = [(key, rank) for key, _, rank in LAYOUT_SIZES if key in self.saved]
        shape = tuple(self.saved[key] for key, _ in recorded)
        return shape, tuple(getattr(runtime, rank) % size for (_, rank), size in zip(recorded, shape))


def reshard_notes(cfg: TrainingConfig, iteration: int) -> list[str]:
    """The lines of a resume at another layout (none at the same one): what is resharded, that the RNG states restart
    from ``--seed`` and the iteration (unless not loaded), and whether the planner's calibration carries over."""
    path = iteration_dir(cfg.checkpoint.load, iteration)
    meta = read_metadata(path)
    reshard = Reshard.of(cfg, meta)
    if not reshard.changed:
        return []
    where = f"--load {cfg.checkpoint.load}: iteration {iteration}"
    loaded = "the model" if cfg.checkpoint.no_load_optim or cfg.checkpoint.finetune else "the model and optimizer states"
    notes = [f"{where} was saved at {reshard.describe(0)}, this run is at {reshard.describe(1)}: {loaded} resharded"
             + ("" if cfg.checkpoint.finetune else
                f"; the data stream goes on at sample {meta['consumed_samples']}, split over this run's data-parallel replicas")]
    if not (cfg.checkpoint.no_load_rng or cfg.checkpoint.finetune):
        notes.append(f"{where}: the random generators restart from --seed {cfg.training.seed} and iteration {iteration} "
                     "(their saved states are per rank of another layout)")
    if not cfg.checkpoint.finetune and has_planner_state(path):
        notes.append(f"{where}: the planner's calibration " + (
            "carries over (every pipeline stage as saved)" if reshard.stages_kept else
            f"restarts from the profile (fitted to the stages of {reshard.describe(0, stages_only=True)})"))
    return notes


def has_planner_state(path: str) -> bool:
    return any(key.startswith(PLANNER_KEY + "/") for key in FileSystemReader(path).read_metadata().state_dict_metadata)
