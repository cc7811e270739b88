#!/usr/bin/env bash
# The main job on its embedded default: byte-level GPT on the Python standard library's sources,
# pipeline-parallel over 2 ranks (CPU + gloo here, CUDA + NCCL on a GPU machine).
# Extra flags are passed to pretrain_gpt.py (e.g. --train-iters 100).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DATA=$(python3 -m megatron_epp.data.stdlib_corpus | tail -n 1)
exec python3 -m torch.distributed.run --nproc-per-node "${NPROC:-2}" pretrain_gpt.py \
  --data-path "$DATA" --tokenizer byte \
  --pipeline-model-parallel-size 2 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 \
  --micro-batch-size 2 --global-batch-size 16 \
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 5 --lr-decay-style cosine --clip-grad 1.0 \
  --train-iters 60 --log-interval 5 --eval-interval 30 --eval-iters 2 \
  "$@"
