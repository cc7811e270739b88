"""Elastic 1F1B order: which chunk each stage runs forward or backward next. Pure Python.

The executor, the simulator and the planner's memory check all walk this one order, so what is
planned is what runs.

* Forward order is the pipeline's chunk order.
* Backward order: sequences first-in-first-out, the slices of a split sequence last-to-first (a
  hybrid chunk belongs to the split sequence whose tail it holds).
* Stage ``p`` of ``P`` runs ``min(N, P - p - 1 + K_max - 1)`` warm-up forwards, then one forward and
  one backward alternately, then the remaining backwards. ``K_max`` is the largest number of chunks
  of one sequence; with ``K_max = 1`` this is Megatron's 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_epp.plan.core import Chunk, Pipeline


@dataclass(frozen=True)
class Op:
    """Run chunk ``pos`` (index in the pipeline's forward order) forward (``F``) or backward (``B``)."""

    kind: Literal["F", "B"]
    pos: int


def split_owner(chunk: Chunk) -> int | None:
    """The split sequence a chunk belongs to: a split chunk's sequence, a hybrid chunk's tail."""
    if chunk.kind == "split":
        return chunk.segments[0].seq
    if chunk.kind == "hybrid":
        return next(s.seq for s in chunk.segments if s.start > 0)
    return None


def sequence_units(pipe: Pipeline) -> list[list[int]]:
    """Chunk positions grouped by split sequence (a batched chunk is a unit of its own), in order."""
    units: list[list[int]] = []
    unit_of_seq: dict[int, list[int]] = {}
    for pos, chunk in enumerate(pipe.chunks):
        owner = split_owner(chunk)
        if owner is not None and owner in unit_of_seq:
            unit_of_seq[owner].append(pos)
            continue
        units.append([pos])
        if owner is not None:
            unit_of_seq[owner] = units[-1]
    return units


def backward_order(pipe: Pipeline) -> list[int]:
    """Chunk positions in backward order: units first-in-first-out, each unit last-to-first."""
    return [pos for unit in sequence_units(pipe) for pos in reversed(unit)]


def max_chunks_per_sequence(pipe: Pipeline) -> int:
    return max(len(u) for u in sequence_units(pipe))


def num_warmup(pipe: Pipeline, stage: int, num_stages: int) -> int:
    """Forwards stage ``stage`` runs before its first backward."""
    return min(len(pipe.chunks), num_stages - stage - 1 + max_chunks_per_sequence(pipe) - 1)


def stage_ops(pipe: Pipeline, stage: int, num_stages: int) -> list[Op]:
    """The full elastic 1F1B op sequence of one stage for one pipeline."""
    n = len(pipe.chunks)
    bwd = backward_order(pipe)
    warm = num_warmup(pipe, stage, num_stages)
    ops = [Op("F", i) for i in range(warm)]
    for j in range(n - warm):
        ops.append(Op("F", warm + j))
        ops.append(Op("B", bwd[j]))
    ops.extend(Op("B", pos) for pos in bwd[n - warm :])
    return ops
