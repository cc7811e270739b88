"""First-contact helper: tests/workers/elastic_equivalence.py unchanged, optionally with every random
document length multiplied by EPP_EQUIV_SCALE (default 1: the test suite's lengths 2..63), so the
same random plans (batched / split / hybrid, 1-3 pipelines) run at CUDA-sized lengths.

    python3 equiv_worker.py OUT --mode reference|elastic --cases N [pretrain_gpt flags]
(one process: initialize() falls back to RANK 0 / WORLD_SIZE 1, NCCL on CUDA, gloo on CPU)
"""

import os
import sys
from pathlib import Path

REPO = Path(os.environ.get("EPP_REPO", Path(__file__).resolve().parent / "repo"))
sys.path.insert(0, str(REPO))

import tests.workers.elastic_equivalence as worker  # noqa: E402
from tests.workers import random_plans  # noqa: E402

scale = int(os.environ.get("EPP_EQUIV_SCALE", "1"))
if scale != 1:
    base = random_plans.random_lengths

    def scaled(rng):
        return [n * scale for n in base(rng)]

    worker.random_lengths = scaled

if __name__ == "__main__":
    sys.exit(worker.main())
