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

from megatron_epp.plan.core import Chunk, Pipeline, Plan

KIND_SUFFIX = {"batched": "", "split": "s", "hybrid": "h"}


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


def plan_stage_ops(plan: Plan) -> list[list[tuple[int, Op]]]:
    """Every stage's ops over the whole plan, pipelines one after another: ``(pipeline index, op)``."""
    return [[(pi, op) for pi, pipe in enumerate(plan.pipelines) for op in stage_ops(pipe, p, plan.num_stages)]
            for p in range(plan.num_stages)]


def op_label(pipe: Pipeline, op: Op) -> str:
    """``F12s``: forward (``F``) or backward (``B``) of chunk id 12, a split (``s``), hybrid (``h``)
    or batched (no suffix) chunk."""
    chunk = pipe.chunks[op.pos]
    return f"{op.kind}{chunk.id}{KIND_SUFFIX[chunk.kind]}"


def format_stage_ops(schedule: Plan | Pipeline, num_stages: int | None = None) -> str:
    """The op order as a table, one column per stage, one row per op index (as
    ``torch.distributed.pipelining`` prints its schedules); cells as :func:`op_label`. A plan's
    pipelines run one after another; with more than one, each row names its pipeline. Rows are the
    order each stage runs its ops in, not a timing: a stage may wait between two rows."""
    if isinstance(schedule, Plan):
        pipes, ops = schedule.pipelines, plan_stage_ops(schedule)
    else:
        if num_stages is None:
            raise ValueError("format_stage_ops of a pipeline needs num_stages")
        pipes, ops = [schedule], [[(0, op) for op in stage_ops(schedule, p, num_stages)] for p in range(num_stages)]
    rows = max(len(column) for column in ops)
    digits = len(str(rows - 1))
    labels = [f"Step {i:0{digits}d}" + (f" p{ops[0][i][0]}" if len(pipes) > 1 else "") for i in range(rows)]
    cells = [[op_label(pipes[pi], op) for pi, op in column] + [""] * (rows - len(column)) for column in ops]
    header = [f"Stage {p}" for p in range(len(ops))]
    widths = [max(len(h), *(len(c) for c in column)) for h, column in zip(header, cells)]
    first = max(len(label) for label in labels)

    def line(label: str, row: list[str]) -> str:
        return "  ".join([label.ljust(first), *(c.ljust(w) for c, w in zip(row, widths))]).rstrip()

    return "\n".join([line("", header), *(line(labels[i], [column[i] for column in cells]) for i in range(rows))])
