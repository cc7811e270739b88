"""The main job (``scripts/main_job.sh``, run by ``scripts/train_default.sh``) shows what EPP does: on global batches
of the stdlib corpus's document lengths at the main job's flags, the plans hold batched, split and hybrid chunks, and
EPP's own plan is predicted faster than Megatron packing's and Seq1F1B's on the same cost model."""

from __future__ import annotations

import collections
import os
import subprocess

import numpy as np

from megatron_epp.data.stdlib_corpus import stdlib_files
from megatron_epp.planner.builders import ELASTIC, MEGATRON, baseline_ratios
from megatron_epp.training.planning import check_memory_budget, online_planner
from megatron_epp.training.replay import parsed_config
from tests.paths import REPO


def main_job_flags() -> list[str]:
    """``MAIN_JOB_ARGS`` of ``scripts/main_job.sh`` without its ``--data-path`` (the corpus is not built here)."""
    script = 'source scripts/main_job.sh && printf "%s\\n" "${MAIN_JOB_ARGS[@]}"'
    flags = subprocess.run(["bash", "-c", script], cwd=REPO, env={**os.environ, "PYTHON": "true"}, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    at = flags.index("--data-path")
    return flags[:at] + flags[at + 2:]


def test_the_main_job_plans_show_epp():
    cfg = parsed_config([*main_job_flags(), "--mock-data"])
    check_memory_budget(cfg)  # its start-up check passes
    planner = online_planner(cfg)
    cap, batch = cfg.model.seq_length, cfg.training.global_batch_size
    # the corpus's documents are its files' bytes (one byte token each), cut at the cap as --epp-truncate-documents does
    lengths = np.minimum([f.stat().st_size for f in stdlib_files()], cap)
    rng = np.random.default_rng(0)
    kinds, own = collections.Counter(), 0
    for _ in range(8):
        step = planner(rng.choice(lengths, batch, replace=False).tolist())
        plan, ratios = step.plan, baseline_ratios(step.report)
        assert plan.builder == ELASTIC.plan_name and len(ratios) == 2 and MEGATRON.plan_name in ratios, ratios
        assert min(ratios.values()) >= 1.0, ratios  # never slower than a baseline it weighed
        own += step.report.chosen == ELASTIC.plan_name and min(ratios.values()) > 1.02
        kinds.update(plan.chunk_counts())
    assert own >= 6, own  # EPP's own plan, faster than both baselines, on most batches
    assert min(kinds[k] for k in ("batched", "split", "hybrid")) > 0, kinds
