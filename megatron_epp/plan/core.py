"""The Plan: which chunks run, in which order, with how much recompute. Plain data, no torch.

A global batch is a list of sequences (token counts). A *chunk* is the unit the elastic pipeline
moves: a list of segments, each a token range ``[start, end)`` of one sequence. ``start`` is the
segment's context length C (tokens of the same sequence in earlier slices).

Chunk kinds:
  * ``batched``: whole sequences packed together (block-diagonal causal attention);
  * ``split``: one slice of a long sequence, alone in its chunk;
  * ``hybrid``: the tail (last) slice of a long sequence packed with whole short sequences.

A plan holds one or more *pipelines* (sequence groups) that run one after another with gradient
accumulation between them; each lists its chunks in forward order and, per stage and chunk, how many
of the stage's layers recompute their activations in backward. What the planner predicted of a plan is
its report, beside it (:mod:`.report`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from numbers import Integral
from typing import Any, Iterable, Literal

ChunkKind = Literal["batched", "split", "hybrid"]
CHUNK_KINDS: tuple[ChunkKind, ...] = ("batched", "split", "hybrid")


class PlanError(ValueError):
    """A plan that breaks a dependency or does not cover the batch exactly."""


class PlanInfeasible(ValueError):
    """The batch cannot be planned within the memory budget."""


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, end)`` of sequence ``seq``; ``start`` is the context length C."""

    seq: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def context(self) -> int:
        return self.start


@dataclass
class Chunk:
    """One micro-batch of the elastic pipeline: segments packed in this order."""

    id: int
    kind: ChunkKind
    segments: list[Segment]

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def lengths(self) -> list[int]:
        return [s.length for s in self.segments]

    @property
    def contexts(self) -> list[int]:
        return [s.context for s in self.segments]

    def cu_seqlens(self) -> list[int]:
        """Cumulative segment boundaries in the packed chunk, ``[0, s0, s0+s1, ...]``."""
        out = [0]
        for s in self.segments:
            out.append(out[-1] + s.length)
        return out

    def position_ids(self) -> list[int]:
        """Absolute position of every token: a slice starts at C, packed sequences at 0."""
        return [p for s in self.segments for p in range(s.start, s.end)]


@dataclass
class Pipeline:
    """One 1F1B pipeline: chunks in forward order and ``recompute[stage][i]`` layers to recompute.

    Activation offload (empty: none, and the plan's JSON has neither key): ``offload[stage][i]`` of chunk ``i``'s
    ``recompute[stage][i]`` checkpointed layers keep their checkpoint (the layer's input) in pinned host memory from
    the chunk's forward until before that layer's backward: the stage's *first* ones (the last to be needed in
    backward); ``kv_host``: the split sequences (ids) whose K/V buffer (and its gradient accumulators) lives in host
    memory, fetched a slice's block at a time ahead of use."""

    chunks: list[Chunk]
    recompute: list[list[int]]
    offload: list[list[int]] = field(default_factory=list)
    kv_host: list[int] = field(default_factory=list)

    def offloaded(self, stage: int) -> list[int]:
        """Offloaded checkpoints per chunk on ``stage`` (zeros without offload)."""
        return list(self.offload[stage]) if self.offload else [0] * len(self.chunks)

    def sequences(self) -> set[int]:
        return {s.seq for c in self.chunks for s in c.segments}


@dataclass
class Plan:
    """A whole training step: the batch's sequence lengths and the pipelines that cover it."""

    seq_lengths: list[int]
    num_stages: int
    layers_per_stage: list[int]
    pipelines: list[Pipeline]
    builder: str = "manual"

    # ----------------------------------------------------------------------------- queries
    def chunks(self) -> Iterable[Chunk]:
        for p in self.pipelines:
            yield from p.chunks

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lengths)

    def chunk_counts(self) -> dict[str, int]:
        counts = {k: 0 for k in CHUNK_KINDS}
        for c in self.chunks():
            counts[c.kind] += 1
        return counts

    def recomputed_layers(self) -> int:
        return sum(sum(row) for p in self.pipelines for row in p.recompute)

    def offloaded_layers(self) -> int:
        """Recompute checkpoints the plan puts in host memory, over its stages and chunks."""
        return sum(sum(row) for p in self.pipelines for row in (p.offload or ()))

    def summary(self, chosen: str | None = None) -> str:
        """One line: the builder (``= chosen``: the plan the elastic builder chose, where not its own) and the counts."""
        counts = self.chunk_counts()
        return (
            f"plan[{self.builder}{'' if chosen in (None, self.builder) else ' = ' + chosen}] seqs={len(self.seq_lengths)} tokens={self.num_tokens} "
            f"chunks={sum(counts.values())} (batched={counts['batched']} split={counts['split']} "
            f"hybrid={counts['hybrid']}) pipelines={len(self.pipelines)} "
            f"recomputed_layers={self.recomputed_layers()}"
            + (f" offloaded_checkpoints={sum(sum(map(sum, p.offload)) for p in self.pipelines)}" if self.offloads() else "")
        )

    # ----------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data; a pipeline without offload has no ``offload`` / ``kv_host`` keys (the JSON of a
        plan without offload is as before offload existed)."""
        d = asdict(self)
        for pipe in d["pipelines"]:
            for key in ("offload", "kv_host"):
                if not pipe[key]:
                    del pipe[key]
        return d

    def offloads(self) -> bool:
        """Whether any checkpoint or K/V buffer of the plan is offloaded to host memory."""
        return any(p.kv_host or any(map(any, p.offload)) for p in self.pipelines)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """The plan of :meth:`to_dict`; the ``stats`` a plan's JSON held before its report was apart (a checkpoint's
        measured plans) are not part of it."""
        pipelines = [
            Pipeline(
                chunks=[
                    Chunk(id=c["id"], kind=c["kind"], segments=[Segment(**s) for s in c["segments"]])
                    for c in p["chunks"]
                ],
                recompute=[list(r) for r in p["recompute"]],
                offload=[list(r) for r in p.get("offload", [])],
                kv_host=list(p.get("kv_host", [])),
            )
            for p in d["pipelines"]
        ]
        return cls(
            seq_lengths=list(d["seq_lengths"]),
            num_stages=d["num_stages"],
            layers_per_stage=list(d["layers_per_stage"]),
            pipelines=pipelines,
            builder=d.get("builder", "manual"),
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    # ----------------------------------------------------------------------------- checks
    def validate(self) -> "Plan":
        """Raise :class:`PlanError` naming the offending chunk if the plan is not executable."""
        if not _is_int(self.num_stages) or not all(map(_is_int, self.layers_per_stage)):
            raise PlanError(f"num_stages {self.num_stages!r} and layers_per_stage {self.layers_per_stage!r} must be integers")
        if self.num_stages < 1 or len(self.layers_per_stage) != self.num_stages:
            raise PlanError(f"layers_per_stage {self.layers_per_stage} does not match {self.num_stages} stages")
        if not all(map(_is_int, self.seq_lengths)):
            raise PlanError(f"sequence lengths must be integers: {self.seq_lengths!r}")
        if any(n < 1 for n in self.seq_lengths):
            raise PlanError(f"empty sequence in batch: lengths {self.seq_lengths}")
        where: dict[int, tuple[int, int]] = {}  # chunk id -> (pipeline, position)
        for pi, pipe in enumerate(self.pipelines):
            for pos, chunk in enumerate(pipe.chunks):
                if not _is_int(chunk.id):
                    raise PlanError(f"chunk {chunk.id!r} (pipeline {pi} position {pos}): the id must be an integer")
                if chunk.id in where:
                    raise PlanError(f"chunk {chunk.id}: the id is used twice, at pipeline {where[chunk.id][0]} position "
                                    f"{where[chunk.id][1]} and at pipeline {pi} position {pos}")
                where[chunk.id] = (pi, pos)
        owner: dict[int, int] = {}
        next_start: dict[int, int] = {}  # sequence -> end of its last slice so far
        last_chunk: dict[int, tuple[int, int]] = {}  # sequence -> (position, id) of the chunk holding that slice
        for pi, pipe in enumerate(self.pipelines):
            if not pipe.chunks:
                raise PlanError(f"pipeline {pi} has no chunks")
            self._validate_recompute(pi, pipe)
            for pos, chunk in enumerate(pipe.chunks):
                self._validate_chunk(chunk)
                for seg in chunk.segments:
                    if owner.setdefault(seg.seq, pi) != pi:
                        raise PlanError(f"chunk {chunk.id}: sequence {seg.seq} is in pipelines {owner[seg.seq]} and {pi}")
                    expected = next_start.get(seg.seq, 0)
                    if seg.start != expected:
                        before = (f"the previous slice (chunk {last_chunk[seg.seq][1]}) ended at {expected}"
                                  if seg.seq in last_chunk else "no earlier chunk holds the sequence")
                        gap = (f"tokens [{expected},{seg.start}) are missing before it" if seg.start > expected
                               else f"tokens [{seg.start},{min(expected, seg.end)}) are in two chunks")
                        raise PlanError(f"chunk {chunk.id}: sequence {seg.seq} tokens [{seg.start},{seg.end}) start at "
                                        f"{seg.start} but {before}: {gap}")
                    if seg.seq in last_chunk and last_chunk[seg.seq][0] != pos - 1:
                        raise PlanError(f"chunk {chunk.id}: slices of sequence {seg.seq} are not consecutive "
                                        f"(the previous one is chunk {last_chunk[seg.seq][1]})")
                    next_start[seg.seq] = seg.end
                    last_chunk[seg.seq] = (pos, chunk.id)
        for seq, n in enumerate(self.seq_lengths):
            if seq not in last_chunk:
                raise PlanError(f"sequence {seq} ({n} tokens) is in no chunk")
            if next_start[seq] != n:
                raise PlanError(f"chunk {last_chunk[seq][1]}: sequence {seq} ends at token {next_start[seq]} of {n}: "
                                f"tokens [{next_start[seq]},{n}) are in no chunk")
        return self

    def _validate_chunk(self, chunk: Chunk) -> None:
        if chunk.kind not in CHUNK_KINDS:
            raise PlanError(f"chunk {chunk.id}: unknown kind {chunk.kind!r}")
        if not chunk.segments:
            raise PlanError(f"chunk {chunk.id}: no segments")
        seqs = [s.seq for s in chunk.segments]
        if len(seqs) != len(set(seqs)):
            raise PlanError(f"chunk {chunk.id}: a sequence appears twice")
        partial = []
        for s in chunk.segments:
            if not (_is_int(s.seq) and _is_int(s.start) and _is_int(s.end)):
                raise PlanError(f"chunk {chunk.id}: segment {s} must hold integers")
            if not 0 <= s.seq < len(self.seq_lengths):
                raise PlanError(f"chunk {chunk.id}: unknown sequence {s.seq}")
            if not 0 <= s.start < s.end <= self.seq_lengths[s.seq]:
                raise PlanError(f"chunk {chunk.id}: bad token range [{s.start},{s.end}) of sequence {s.seq}")
            if s.length != self.seq_lengths[s.seq]:
                partial.append(s)
        if len(partial) > 1:
            raise PlanError(f"chunk {chunk.id}: holds {len(partial)} slices; at most one (a tail) may be packed")
        if partial and len(chunk.segments) > 1 and partial[0].end != self.seq_lengths[partial[0].seq]:
            raise PlanError(f"chunk {chunk.id}: only a tail slice may be packed with whole sequences")
        kind = chunk_kind(chunk.segments, self.seq_lengths)
        if kind != chunk.kind:
            raise PlanError(f"chunk {chunk.id}: kind is {chunk.kind!r} but its segments make it {kind!r}")

    def _validate_recompute(self, pi: int, pipe: Pipeline) -> None:
        if len(pipe.recompute) != self.num_stages or any(len(r) != len(pipe.chunks) for r in pipe.recompute):
            raise PlanError(f"pipeline {pi}: recompute must be [{self.num_stages} stages][{len(pipe.chunks)} chunks]")
        for stage, row in enumerate(pipe.recompute):
            for pos, n in enumerate(row):
                if not _is_int(n):
                    raise PlanError(f"chunk {pipe.chunks[pos].id}: recompute {n!r} layers on stage {stage} (must be an integer)")
                if not 0 <= n <= self.layers_per_stage[stage]:
                    raise PlanError(
                        f"chunk {pipe.chunks[pos].id}: recompute {n} layers on stage {stage} "
                        f"(it has {self.layers_per_stage[stage]})"
                    )
        self._validate_offload(pi, pipe)

    def _validate_offload(self, pi: int, pipe: Pipeline) -> None:
        if pipe.offload and (len(pipe.offload) != self.num_stages or any(len(r) != len(pipe.chunks) for r in pipe.offload)):
            raise PlanError(f"pipeline {pi}: offload must be [{self.num_stages} stages][{len(pipe.chunks)} chunks] or empty")
        for stage, row in enumerate(pipe.offload):
            for pos, n in enumerate(row):
                if not _is_int(n) or not 0 <= n <= pipe.recompute[stage][pos]:
                    raise PlanError(f"chunk {pipe.chunks[pos].id}: offload {n!r} checkpoints on stage {stage} (an integer "
                                    f"from 0 to its {pipe.recompute[stage][pos]} checkpointed layers)")
        split = {s.seq for c in pipe.chunks for s in c.segments if s.length != self.seq_lengths[s.seq]}
        for seq in pipe.kv_host:
            if seq not in split:
                raise PlanError(f"pipeline {pi}: kv_host {seq!r}: not a sequence split in this pipeline")


def _is_int(x: object) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def split_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage for an even pipeline split (Megatron requires divisibility)."""
    if num_layers % num_stages:
        raise PlanError(f"{num_layers} layers do not divide into {num_stages} pipeline stages")
    return [num_layers // num_stages] * num_stages


def chunk_kind(segments: list[Segment], seq_lengths: list[int]) -> ChunkKind:
    """Kind a list of segments makes (used by plan builders)."""
    partial = [s for s in segments if s.length != seq_lengths[s.seq]]
    if not partial:
        return "batched"
    return "split" if len(segments) == 1 else "hybrid"
