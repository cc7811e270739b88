"""Elastic 1F1B order: which chunk each stage runs forward or backward next, and what it sends and receives. Pure Python.

The executor, the simulator and the planner's memory check all walk this one order, so what is
planned is what runs.

* Forward order is the pipeline's chunk order.
* Backward order: sequences first-in-first-out, the slices of a split sequence last-to-first (a
  hybrid chunk belongs to the split sequence whose tail it holds).
* Stage ``p`` of ``P`` runs ``min(N, P - p - 1 + K_max - 1)`` warm-up forwards, then one forward and
  one backward alternately, then the remaining backwards. ``K_max`` is the largest number of chunks
  of one sequence; with ``K_max = 1`` this is Megatron's 1F1B.
* Sends and receives are ops of the same lists (:func:`add_send_recv`, as
  ``torch.distributed.pipelining``'s ``_add_send_recv``): each compute op receives its input just before
  it runs and sends its result right after; where 1F1B pairs a send with the next op's receive (a
  forward's output with the gradient for the next backward, a backward's input gradient with the input
  of the next forward) the receive is ``batched`` with the send, posted together as Megatron's
  ``send_forward_recv_backward`` / ``send_backward_recv_forward``. The first stage receives no forward
  input and sends no input gradient, the last sends no forward output and receives no output gradient.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from megatron_epp.plan.core import Chunk, Pipeline, Plan

KIND_SUFFIX = {"batched": "", "split": "s", "hybrid": "h"}
OpKind = Literal["F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
_OP = re.compile(r"(\+?)(F|B|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)")


@dataclass(frozen=True)
class Op:
    """One op of a stage on chunk ``pos`` (index in the pipeline's forward order): run it forward (``F``) or
    backward (``B``); send its forward output to the next stage (``SEND_F``) or its input gradient to the previous
    one (``SEND_B``); receive its forward input (``RECV_F``) or its output gradient (``RECV_B``). ``batched``: a
    receive posted together with the send just before it (written ``+RECV_B3``)."""

    kind: OpKind
    pos: int
    batched: bool = False

    def __str__(self) -> str:
        return f"{'+' if self.batched else ''}{self.kind}{self.pos}"

    @classmethod
    def from_str(cls, text: str) -> "Op":
        """The op written as :meth:`__str__` writes it: ``F3``, ``B0``, ``SEND_F3``, ``RECV_B1``, ``+RECV_B1``."""
        match = _OP.fullmatch(text.strip())
        if match is None or (match.group(1) and not match.group(2).startswith("RECV")):
            raise ValueError(f"not an op: {text!r} (expected F3, B3, SEND_F3, RECV_F3, SEND_B3, RECV_B3 or +RECV_B3)")
        return cls(match.group(2), int(match.group(3)), bool(match.group(1)))  # type: ignore[arg-type]

    @classmethod
    def list_from_str(cls, text: str) -> list["Op"]:
        """Ops separated by blanks: ``"RECV_F0 F0 SEND_F0 +RECV_B0 B0"``."""
        return [cls.from_str(t) for t in text.split()]


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


def stage_ops(pipe: Pipeline, stage: int, num_stages: int, *, comms: bool = False, forward_only: bool = False) -> list[Op]:
    """The elastic 1F1B op sequence of one stage for one pipeline: its forwards and backwards (``forward_only``:
    its forwards); ``comms``: with its sends and receives (:func:`add_send_recv`)."""
    n = len(pipe.chunks)
    warm = n if forward_only else num_warmup(pipe, stage, num_stages)
    bwd = [] if forward_only else backward_order(pipe)
    ops = [Op("F", i) for i in range(warm)]
    for j in range(n - warm):
        ops.append(Op("F", warm + j))
        ops.append(Op("B", bwd[j]))
    ops.extend(Op("B", pos) for pos in bwd[n - warm :])
    return add_send_recv(ops, stage, num_stages) if comms else ops


def add_send_recv(ops: list[Op], stage: int, num_stages: int) -> list[Op]:
    """Stage ``stage``'s compute ops with their sends and receives: each op's receive just before it (batched with
    the send before it where that send goes the other way: 1F1B's paired exchange), its send right after it."""
    first, last = stage == 0, stage == num_stages - 1
    out: list[Op] = []
    for op in ops:
        if op.kind == "F":
            if not first:  # batched with a backward's send of the input gradient just before
                out.append(Op("RECV_F", op.pos, bool(out) and out[-1].kind == "SEND_B"))
            out.append(op)
            if not last:
                out.append(Op("SEND_F", op.pos))
        elif op.kind == "B":
            if not last:  # batched with a forward's send of its output just before
                out.append(Op("RECV_B", op.pos, bool(out) and out[-1].kind == "SEND_F"))
            out.append(op)
            if not first:
                out.append(Op("SEND_B", op.pos))
        else:
            raise ValueError(f"add_send_recv takes compute ops (F, B), got {op}")
    return out


def plan_stage_ops(plan: Plan, *, comms: bool = False) -> list[list[tuple[int, Op]]]:
    """Every stage's ops over the whole plan, pipelines one after another: ``(pipeline index, op)``;
    ``comms``: with the sends and receives."""
    return [[(pi, op) for pi, pipe in enumerate(plan.pipelines) for op in stage_ops(pipe, p, plan.num_stages, comms=comms)]
            for p in range(plan.num_stages)]


def op_label(pipe: Pipeline, op: Op) -> str:
    """``F12s``: forward (``F``) or backward (``B``) of chunk id 12, a split (``s``), hybrid (``h``)
    or batched (no suffix) chunk; ``SEND_F12s``, ``+RECV_B12s``: its transfers (as :class:`Op` writes them)."""
    chunk = pipe.chunks[op.pos]
    return f"{'+' if op.batched else ''}{op.kind}{chunk.id}{KIND_SUFFIX[chunk.kind]}"


def format_stage_ops(schedule: Plan | Pipeline, num_stages: int | None = None, *, comms: bool = True) -> str:
    """The op order as a table, one column per stage, one row per op index (as
    ``torch.distributed.pipelining`` prints its schedules); cells as :func:`op_label`, the sends and
    receives included (``comms``; the ops the executor and the simulator run). A plan's pipelines run
    one after another; with more than one, each row names its pipeline (a stage with fewer ops in a
    pipeline leaves its last cells of that pipeline blank). Rows are the order each stage runs its ops
    in, not a timing: a stage may wait between two rows."""
    if isinstance(schedule, Plan):
        pipes, num_stages = schedule.pipelines, schedule.num_stages
    else:
        if num_stages is None:
            raise ValueError("format_stage_ops of a pipeline needs num_stages")
        pipes = [schedule]
    labels: list[str] = []
    cells: list[list[str]] = [[] for _ in range(num_stages)]
    for pi, pipe in enumerate(pipes):
        ops = [[op_label(pipe, op) for op in stage_ops(pipe, p, num_stages, comms=comms)] for p in range(num_stages)]
        rows = max(len(column) for column in ops)
        labels += [f" p{pi}" if len(pipes) > 1 else ""] * rows
        for column, stage_cells in zip(cells, ops):
            column += stage_cells + [""] * (rows - len(stage_cells))
    digits = len(str(len(labels) - 1))
    labels = [f"Step {i:0{digits}d}{label}" for i, label in enumerate(labels)]
    header = [f"Stage {p}" for p in range(num_stages)]
    widths = [max(len(h), *(len(c) for c in column)) for h, column in zip(header, cells)]
    first = max(len(label) for label in labels)

    def line(label: str, row: list[str]) -> str:
        return "  ".join([label.ljust(first), *(c.ljust(w) for c, w in zip(row, widths))]).rstrip()

    return "\n".join([line("", header), *(line(labels[i], [column[i] for column in cells]) for i in range(len(labels)))])
