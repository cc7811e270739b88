"""Run ``pretrain_gpt.py`` for the measurement scripts, and rebuild the plans it ran (training's launcher and
planner wiring, which the scripts share; it moved here from ``megatron_epp.tools``: the planner never imports training).

The cost model's calibration on real steps (the machine's speed factor ``s`` and the executor's
per-chunk stage overhead ``o``) is the library's :mod:`megatron_epp.planner.calibration`, which the
training driver also runs online. This module runs ``pretrain_gpt.py --elastic-pp`` under
``torchrun``, reads each step's metrics record (:class:`~megatron_epp.training.metrics.StepMetrics`):
the plan summary and the *measured ms* (the run of ``forward_backward_elastic`` on the last stage:
every pipeline of the plan plus ``finalize_model_grads``; planning, the optimizer step and the loss
broadcast are outside it, as they are outside the simulator's step), and rebuilds the very same plans
in-process (same flags, same document stream, same uncalibrated planner: checked against the logged
summary by the callers), for ``benchmarks/calibrate_step.py`` to fit ``s`` and ``o`` offline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from megatron_epp.cost.model import CostModel
from megatron_epp.plan import PlannedStep
from megatron_epp.config.parser import parse_config
from megatron_epp.config.fields import TrainingConfig
from megatron_epp.training.metrics import StepMetrics, read_metrics
from megatron_epp.training.planning import elastic_sampler, online_planner

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


def reconstruct_plans(argv: Sequence[str], iterations: int, world_size: int = 2) -> tuple[list[PlannedStep], CostModel]:
    """The plans ``pretrain_gpt.py argv`` runs in its first ``iterations`` steps (data-parallel rank 0), with their reports,
    rebuilt in this process from the same flags, document stream and planner; and the planner's cost
    model (the profile on this run's model shape and stages). Rebuilt on the profile as given: a run
    that calibrates (``--epp-calibrate-interval`` > 0) plans differently after its first fit."""
    cfg = parsed_config(argv, world_size)
    planner = online_planner(cfg)
    batches = elastic_sampler(cfg, "train", cfg.parallel.dims.dp, planner).iterate(0)
    plans = []
    for _ in range(iterations):
        batch = next(batches)
        plans.append(planner(batch.seq_lengths[batch.positions(0)].tolist()))  # validated
    return plans, planner.cost_model


def parsed_config(argv: Sequence[str], world_size: int = 2) -> TrainingConfig:
    """``pretrain_gpt.py``'s configuration for ``argv`` (validated, vocabulary size resolved), in-process."""
    return parse_config(list(argv), world_size=world_size)
