#!/usr/bin/env bash
# The test command (README and CI): install the pinned environment, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
exec python3 -m pytest -q --durations=15 "$@"
