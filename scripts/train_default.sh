#!/usr/bin/env bash
# The main job on its embedded default (scripts/main_job.sh): byte-level GPT with --elastic-pp on the
# Python standard library's sources, pipeline-parallel over 2 ranks (CPU + gloo here, CUDA + NCCL on
# a GPU machine). Extra flags are passed to pretrain_gpt.py and override the defaults
# (e.g. --train-iters 100).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source scripts/main_job.sh
exec python3 -m megatron_epp.training.launch --nproc-per-node "${NPROC:-2}" pretrain_gpt.py "${MAIN_JOB_ARGS[@]}" "$@"
