"""The parallel layout of a run, one value every stage shares: :class:`ParallelDims`."""

from __future__ import annotations

from dataclasses import dataclass

# How a stage's context-parallel ranks split a chunk's attention: Ulysses all-to-all, Megatron-LM's ``--cp-comm-type
# a2a`` (its others are not implemented here); the one spelling of it for the arguments, the model and the planner
CP_COMM_TYPE = "a2a"


@dataclass(frozen=True)
class ParallelDims:
    """The parallel layout a run plans for: tensor-parallel size ``tp`` (with ``sequence_parallel``),
    pipeline stages ``pp``, data-parallel replicas ``dp`` and context-parallel ranks ``cp`` per stage (Ulysses:
    each chunk's tokens split over them, heads split over them inside attention). Megatron-core's rank order
    (tp-cp-dp-pp) lays these sizes out over the world: :meth:`for_world` makes one that fills a world size."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp, self.cp) < 1:
            raise ValueError(f"parallel sizes must be >= 1 (tp {self.tp}, pp {self.pp}, dp {self.dp}, cp {self.cp})")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None,
                  sequence_parallel: bool = False) -> "ParallelDims":
        """The layout of ``world_size`` ranks: ``dp`` None (or -1) is inferred, the ranks ``tp x cp x pp`` leave
        (``world_size`` must be a multiple of their product); a given ``dp`` must fill the world exactly. Raises
        :class:`ValueError` with a one-line message otherwise."""
        if world_size < 1:
            raise ValueError(f"world size {world_size} must be >= 1")
        if min(tp, pp, cp) < 1:
            raise ValueError(f"parallel sizes must be >= 1 (tp {tp}, pp {pp}, dp {dp}, cp {cp})")
        if dp is None or dp == -1:
            if world_size % (tp * cp * pp):
                raise ValueError(f"world size {world_size} is not divisible by tp {tp} x cp {cp} x pp {pp}")
            dp = world_size // (tp * cp * pp)
        dims = cls(tp, pp, dp, cp, sequence_parallel)
        dims.check_world_size(world_size)
        return dims

    def check_world_size(self, world_size: int) -> None:
        """Raise :class:`ValueError` (one line) unless ``tp x cp x pp x dp`` is ``world_size``."""
        if self.world_size != world_size:
            raise ValueError(f"tp {self.tp} x cp {self.cp} x pp {self.pp} x dp {self.dp} = {self.world_size} ranks, "
                             f"but the world size is {world_size}")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage of a replica: ``tp x cp``."""
        return self.tp * self.cp

    def __str__(self) -> str:
        """The layout as the layout search names it: ``TP8xCP2xPP1xDP4`` (``CP`` only above 1)."""
        return f"TP{self.tp}{f'xCP{self.cp}' if self.cp > 1 else ''}xPP{self.pp}xDP{self.dp}"

    def flags(self) -> list[str]:
        """``pretrain_gpt.py``'s flags for this layout (data parallel: the rest of the world size); a CP layout's
        include ``--cp-comm-type`` and ``--elastic-pp`` (context parallelism runs with it only)."""
        out = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp), "--cp-comm-type", CP_COMM_TYPE, "--elastic-pp"]
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        return out
