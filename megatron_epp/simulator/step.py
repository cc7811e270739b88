"""Event-driven simulation of a Plan on ``P`` stages: per-stage timeline, step time, memory.

Every stage runs its ops in the order of :func:`megatron_epp.plan.order.stage_ops`, sends and receives
included: the lists the executor runs (pipelines one after another, no barrier between them: gradient
accumulation needs none). A receive waits for the other stage's send plus one point-to-point time
(a forward's input: the previous stage's forward of the chunk; a backward's output gradient: the next
stage's backward); a forward or backward starts when the stage is free. A backward also recomputes
the chunk's checkpointed layers first. Peak memory comes from the exact walk of :mod:`memory`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_epp.plan import Plan
from megatron_epp.cost.features import chunk_features
from megatron_epp.cost.model import ChunkCosts, CostModel
from megatron_epp.simulator.memory import peak_host_memory, peak_memory
from megatron_epp.simulator.offload import exposed_ms
from megatron_epp.plan.order import format_stage_ops, op_label, plan_stage_ops


class ScheduleDeadlock(RuntimeError):
    """No stage can run its next op: the order contradicts the dependencies."""


@dataclass
class Event:
    stage: int
    op: str  # "F" or "B"
    pipeline: int
    pos: int  # chunk position in its pipeline
    chunk_id: int
    chunk_kind: str
    start: float
    end: float
    recompute_ms: float  # part of a backward spent recomputing (at its start)


@dataclass
class SimResult:
    step_ms: float
    busy_ms: np.ndarray  # (P,) compute time of each stage, recompute included
    recompute_ms: float  # summed over stages
    peak_memory: np.ndarray  # (P,) bytes
    events: list[Event] = field(default_factory=list)
    # activation offload: per stage the peak host bytes of a GPU (zeros without offload), and the copy time no
    # compute hides, summed over stages (part of the busy time: a stage waits for its copies)
    host_memory: np.ndarray | None = None
    copy_ms: float = 0.0

    @property
    def bubble_ratio(self) -> float:
        """Mean idle fraction of the stages over the step."""
        return float(1.0 - self.busy_ms.mean() / self.step_ms) if self.step_ms > 0 else 0.0


def plan_costs(plan: Plan, cost_model: CostModel) -> list[ChunkCosts]:
    """Costs of every pipeline's chunks in its forward order."""
    return [cost_model.costs(chunk_features(p.chunks)) for p in plan.pipelines]


def simulate(plan: Plan, cost_model: CostModel, costs: list[ChunkCosts] | None = None) -> SimResult:
    """Simulate one training step of ``plan``."""
    costs = costs or plan_costs(plan, cost_model)
    copies = _copies(plan, cost_model, costs)
    events, free = _run(plan, costs, copies)
    busy = np.zeros(plan.num_stages)
    for e in events:
        busy[e.stage] += e.end - e.start
    states = cost_model.model_state_bytes()
    peaks = np.max([peak_memory(pipe, c, cost_model.layers, states) for pipe, c in zip(plan.pipelines, costs)], axis=0)
    host = np.max([peak_host_memory(pipe, c, cost_model.layers) for pipe, c in zip(plan.pipelines, costs)], axis=0)
    copy_ms = float(sum(f.sum() + b.sum() for f, b in copies)) if copies else 0.0
    return SimResult(float(free.max()), busy, float(sum(e.recompute_ms for e in events)), peaks, events, host, copy_ms)


def _copies(plan: Plan, cost_model: CostModel, costs: list[ChunkCosts]) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Per pipeline the exposed copy time of its offload (forward, backward; :mod:`.offload`), None without offload."""
    if not plan.offloads():
        return None
    return [exposed_ms(pipe, c, cost_model.layers, cost_model.host) for pipe, c in zip(plan.pipelines, costs)]


def step_ms(plan: Plan, cost_model: CostModel) -> float:
    """The simulated step time of ``plan`` alone, without the memory walk: for fits that simulate the
    same plans many times."""
    costs = plan_costs(plan, cost_model)
    return float(_run(plan, costs, _copies(plan, cost_model, costs))[1].max())


def _run(plan: Plan, costs: list[ChunkCosts], copies: list[tuple[np.ndarray, np.ndarray]] | None = None) -> tuple[list[Event], np.ndarray]:
    """Every forward and backward of the step as an event, and the time each stage finishes. The stages walk
    their op lists with the sends and receives (:func:`~megatron_epp.plan.order.plan_stage_ops`): a send takes
    no stage time and leaves at the stage's current time; a receive waits until its send has left and crossed
    the link (the chunk's point-to-point time); a backward needs its chunk's forward on the same stage. ``copies``:
    per pipeline the exposed offload copy time of each forward and backward, added to it."""
    P = plan.num_stages
    queues = plan_stage_ops(plan, comms=True)
    # the costs as Python floats (the same doubles, read faster than numpy scalars)
    if copies:
        fwd, bwd = [(c.fwd + f).tolist() for c, (f, _) in zip(costs, copies)], [(c.bwd + b).tolist() for c, (_, b) in zip(costs, copies)]
    else:
        fwd, bwd = [c.fwd.tolist() for c in costs], [c.bwd.tolist() for c in costs]
    p2p, rc_layer = [c.p2p_ms.tolist() for c in costs], [c.rc_layer.tolist() for c in costs]
    sent: dict[tuple[str, int, int, int], float] = {}  # ("F" | "B", pipeline, stage, chunk) -> when its send left
    forwarded: set[tuple[int, int, int]] = set()  # (pipeline, stage, chunk) whose forward ran
    free = [0.0] * P
    nxt = [0] * P
    events: list[Event] = []
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for p in range(P):
            queue = queues[p]
            while nxt[p] < len(queue):
                pi, op = queue[nxt[p]]
                k, kind = op.pos, op.kind
                if kind == "SEND_F" or kind == "SEND_B":
                    sent[kind[-1], pi, p, k] = free[p]
                elif kind == "RECV_F" or kind == "RECV_B":
                    left = sent.get((kind[-1], pi, p - 1 if kind == "RECV_F" else p + 1, k))
                    if left is None:
                        break
                    free[p] = max(free[p], left + p2p[pi][k])
                else:
                    if kind == "F":
                        rc, dur = 0.0, fwd[pi][p][k]
                        forwarded.add((pi, p, k))
                    elif (pi, p, k) not in forwarded:  # a backward needs its chunk's forward on this stage
                        break
                    else:
                        rc = plan.pipelines[pi].recompute[p][k] * rc_layer[pi][k]
                        dur = bwd[pi][p][k] + rc
                    start = free[p]
                    free[p] = start + dur
                    chunk = plan.pipelines[pi].chunks[k]
                    events.append(Event(p, kind, pi, k, chunk.id, chunk.kind, start, free[p], rc))
                nxt[p] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = ", ".join(f"stage {p} at step {i} ({op_label(plan.pipelines[q[i][0]], q[i][1])})"
                                for p, (q, i) in enumerate(zip(queues, nxt)) if i < len(q))
            raise ScheduleDeadlock(f"no stage can run its next op: {waiting}; the op order:\n{format_stage_ops(plan)}")
    return events, np.array(free)
