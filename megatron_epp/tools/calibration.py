"""Calibrate the cost model against real executor steps, and the training launcher the benchmarks share.

The layer profile (``scripts/profile_layer.py``) times layers in isolation; a real elastic step also
pays, per chunk and stage, megatron-core's ``forward_step``/``backward_step``, the chunk's layout,
the point-to-point calls over gloo and their synchronisation, the embedding, autograd hooks. This
module runs ``pretrain_gpt.py --elastic-pp`` under ``torchrun``, reads each step's metrics record
(:class:`~megatron_epp.training.metrics.StepMetrics`): the plan summary and the *measured ms* (the
run of ``forward_backward_elastic`` on the last stage: every pipeline of the plan plus
``finalize_model_grads``; planning, the optimizer step and the loss broadcast are outside it, as they
are outside the simulator's step), rebuilds the very same plans in-process (same
flags, same document stream, same planner: checked against the logged summary), and fits the
executor's per-chunk stage overhead (:class:`~megatron_epp.cost.profiles.StageOverhead`) by least
squares of the simulator's step time against the measured one.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from scipy.optimize import least_squares, minimize_scalar

from megatron_epp.cost.model import CostModel
from megatron_epp.cost.profiles import Profile, StageOverhead
from megatron_epp.plan import Plan
from megatron_epp.simulator.step import simulate
from megatron_epp.training.arguments import parse_args
from megatron_epp.training.elastic import PlanBuilder, elastic_sampler
from megatron_epp.training.main import resolve_vocab_size
from megatron_epp.training.metrics import StepMetrics, read_metrics

REPO = Path(__file__).resolve().parents[2]


def run_pretrain(argv: Sequence[str], nproc: int = 2, timeout: float = 900) -> list[StepMetrics]:
    """Run ``pretrain_gpt.py`` under ``torchrun`` (one thread per rank) and return its logged training
    steps (its ``--epp-metrics`` records); raise ``RuntimeError`` with the error line on failure."""
    with tempfile.TemporaryDirectory(prefix="epp-calibration-") as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(REPO / "pretrain_gpt.py"),
               *argv, "--epp-metrics", str(metrics)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout)
        if out.returncode:
            lines = [line for line in (out.stdout + out.stderr).strip().splitlines() if line.strip()]
            said = [line for line in lines if "error: " in line] or lines[-1:]
            raise RuntimeError(f"pretrain_gpt.py failed ({out.returncode}): {said[-1] if said else ''}")
        return [m for m in read_metrics(metrics) if m.kind == "train"]


def reconstruct_plans(argv: Sequence[str], iterations: int, world_size: int = 2) -> tuple[list[Plan], CostModel]:
    """The plans ``pretrain_gpt.py argv`` runs in its first ``iterations`` steps (data-parallel rank 0),
    rebuilt in this process from the same flags, document stream and planner; and the planner's cost
    model (the profile on this run's model shape and stages)."""
    args = parsed_args(argv, world_size)
    build = PlanBuilder(args)
    batches = elastic_sampler(args, "train", args.data_parallel_size, build).iterate(0)
    plans = []
    for _ in range(iterations):
        batch = next(batches)
        plans.append(build(batch.seq_lengths[batch.positions(0)].tolist()).validate())
    return plans, build.cost_model


def parsed_args(argv: Sequence[str], world_size: int = 2):
    """``pretrain_gpt.py``'s validated arguments for ``argv`` (vocabulary size resolved), in-process."""
    args = parse_args(list(argv), world_size=world_size)
    resolve_vocab_size(args)
    return args


def with_overhead(profile: Profile, fwd_ms: float, bwd_ms: float, fit: dict | None = None) -> Profile:
    return dataclasses.replace(profile, overhead=StageOverhead(float(fwd_ms), float(bwd_ms), dict(fit or {})))


def simulate_steps(plans: Sequence[Plan], cost_model: CostModel, fwd_ms: float | None = None, bwd_ms: float | None = None) -> np.ndarray:
    """Simulated step ms of ``plans`` on ``cost_model``, its profile's stage overhead replaced by
    ``fwd_ms``/``bwd_ms`` when given."""
    cm = cost_model
    if fwd_ms is not None:
        cm = CostModel(with_overhead(cm.profile, fwd_ms, bwd_ms or 0.0), cm.num_stages, cm.layers, cm.dp, cm.network)
    return np.array([simulate(p, cm).step_ms for p in plans])


@dataclass
class OverheadFit:
    per_chunk_ms: float  # fwd + bwd overhead per chunk and stage
    fwd_share: float
    step_const_ms: float  # diagnostic: a per-step constant fitted alongside (not in the model)
    slowdown: float  # measured / modelled speed of the layers (1: none fitted; > 1: this machine was slower)
    rel_err_before: np.ndarray
    rel_err_after: np.ndarray

    @property
    def fwd_ms(self) -> float:
        return self.per_chunk_ms * self.fwd_share

    @property
    def bwd_ms(self) -> float:
        return self.per_chunk_ms * (1 - self.fwd_share)


def fit_overhead(plans: Sequence[Plan], measured_ms: Sequence[float], cost_model: CostModel, fwd_share: float = 0.5,
                 slowdown: bool = False) -> OverheadFit:
    """Least squares (relative residuals) of the simulated step time against ``measured_ms`` over the
    per-chunk stage overhead ``o`` (split ``fwd_share`` / ``1 - fwd_share`` between forward and
    backward), on ``cost_model`` with its profile's own overhead removed. The simulator's step is a
    max-plus function of ``o`` (piecewise linear, increasing), so a bounded scalar search suffices.
    A second fit with an added per-step constant is returned as a diagnostic of what ``o`` absorbs.

    ``slowdown``: fit ``measured = s * simulated(o)`` instead, with a free factor ``s`` for a machine
    that runs everything ``s`` times slower than when the layers were profiled (other jobs sharing the
    cores): ``o`` then comes out in the profile's units and ``s`` is reported, not modelled."""
    y = np.asarray(measured_ms, dtype=float)

    def sim(o: float) -> np.ndarray:
        return simulate_steps(plans, cost_model, o * fwd_share, o * (1 - fwd_share))

    before = sim(0.0)
    chunks = np.array([sum(len(p.chunks) for p in plan.pipelines) for plan in plans], dtype=float)
    hi = max(float(np.max((y - before) / np.maximum(chunks, 1))), 0.0) * 2 + 1.0
    res = minimize_scalar(lambda o: float(np.sum((sim(o) / y - 1) ** 2)), bounds=(0.0, hi), method="bounded",
                          options={"xatol": 1e-4})
    o, s = float(res.x), 1.0
    if slowdown:
        scaled = least_squares(lambda t: t[1] * sim(t[0]) / y - 1, x0=[o / 2, 2.0], bounds=([0.0, 0.1], [hi, 100.0]),
                               diff_step=1e-3)
        o, s = float(scaled.x[0]), float(scaled.x[1])
    both = least_squares(lambda t: (sim(t[0]) + t[1]) / y - 1, x0=[o, 0.0], bounds=([0.0, 0.0], [hi, float(y.max())]))
    return OverheadFit(o, fwd_share, float(both.x[1]), s, before / y - 1, sim(o) / y - 1)


def median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")
