"""Random valid plans over random length mixes: every chunk kind, 1-8 slices, 1-3 pipelines."""

from __future__ import annotations

import numpy as np

from megatron_epp.plan import Chunk, Pipeline, Plan, Segment, chunk_kind


def random_lengths(rng: np.random.Generator) -> list[int]:
    n = int(rng.integers(2, 7))
    return [int(rng.integers(24, 64)) if rng.random() < 0.4 else int(rng.integers(2, 16)) for _ in range(n)]


def _units(rng: np.random.Generator, seqs: list[int], lengths: list[int]) -> list[list[list[Segment]]]:
    """Chunks (as segment lists) grouped by unit: a split sequence's slices, or one batched chunk."""
    split, whole = [], []
    for s in seqs:
        n = int(rng.integers(2, min(8, lengths[s]) + 1)) if lengths[s] >= 24 and rng.random() < 0.8 else 1
        (split if n > 1 else whole).append((s, n))
    units: list[list[list[Segment]]] = []
    whole_ids = [s for s, _ in whole]
    rng.shuffle(whole_ids)
    for s, n in split:
        cuts = sorted(rng.choice(np.arange(1, lengths[s]), size=n - 1, replace=False).tolist())
        bounds = [0, *cuts, lengths[s]]
        slices = [[Segment(s, a, b)] for a, b in zip(bounds[:-1], bounds[1:])]
        while whole_ids and rng.random() < 0.5:  # hybrid tail
            w = whole_ids.pop()
            slices[-1].append(Segment(w, 0, lengths[w]))
        units.append(slices)
    while whole_ids:
        k = int(rng.integers(1, 4))
        units.append([[Segment(w, 0, lengths[w]) for w in whole_ids[:k]]])
        whole_ids = whole_ids[k:]
    return units


def random_plan(rng: np.random.Generator, lengths: list[int], stages: int, layers_per_stage: int) -> Plan:
    order = rng.permutation(len(lengths)).tolist()
    groups = int(rng.integers(1, min(3, len(lengths)) + 1))
    cuts = sorted(rng.choice(np.arange(1, len(lengths)), size=groups - 1, replace=False).tolist()) if groups > 1 else []
    pipelines, next_id = [], 0
    for seqs in np.split(np.array(order), cuts):
        units = _units(rng, [int(s) for s in seqs], lengths)
        rng.shuffle(units)
        chunks = []
        for segments in (c for u in units for c in u):
            chunks.append(Chunk(next_id, chunk_kind(segments, lengths), segments))
            next_id += 1
        pipelines.append(Pipeline(chunks, [[0] * len(chunks) for _ in range(stages)]))
    return Plan(lengths, stages, [layers_per_stage] * stages, pipelines, builder="random").validate()
