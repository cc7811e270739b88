#!/usr/bin/env bash
# A LLaMA-style model in Megatron-LM's flag names, trained with --elastic-pp: SwiGLU MLP, RMSNorm,
# grouped-query attention, no biases, RoPE with base 500000, untied output layer; byte-level on the
# Python standard library's sources (one document per file, as scripts/main_job.sh), pipeline-parallel
# over 2 ranks (CPU + gloo here, CUDA + NCCL on a GPU machine). Sizes are scaled to a CPU; extra flags
# are passed to pretrain_gpt.py and override these (the last one given wins):
#
#   bash examples/llama_style.sh                                   # 20 steps, loss printed every step
#   bash examples/llama_style.sh --train-iters 200 --save ckpt     # longer, with checkpoints
#   NPROC=4 bash examples/llama_style.sh --pipeline-model-parallel-size 4
#
# Sourced, it only sets LLAMA_STYLE_ARGS, e.g. to submit the same model, bigger, through SLURM:
#
#   source examples/llama_style.sh
#   sbatch -N 2 --gpus-per-node 8 scripts/slurm/train.sbatch "${LLAMA_STYLE_ARGS[@]}" --bf16 \
#       --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 \
#       --ffn-hidden-size 14336 --seq-length 8192 --pipeline-model-parallel-size 8 --train-iters 10000
# shellcheck disable=SC2034  # LLAMA_STYLE_ARGS is read by whoever sources this
LLAMA_STYLE_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LLAMA_STYLE_DATA=$(cd "$LLAMA_STYLE_REPO" && PYTHONPATH="$LLAMA_STYLE_REPO${PYTHONPATH:+:$PYTHONPATH}" \
  "${PYTHON:-python3}" -m megatron_epp.data.stdlib_corpus | tail -n 1)
LLAMA_STYLE_ARGS=(
  --data-path "$LLAMA_STYLE_DATA" --tokenizer-type ByteTokenizer
  --pipeline-model-parallel-size 2
  --num-layers 4 --hidden-size 128 --num-attention-heads 8
  --group-query-attention --num-query-groups 2
  --swiglu --ffn-hidden-size 352
  --normalization RMSNorm --norm-epsilon 1e-5
  --disable-bias-linear
  --position-embedding-type rope --rotary-base 500000
  --untie-embeddings-and-output-weights
  --elastic-pp --seq-length 1024 --epp-truncate-documents --global-batch-size 8
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1
  --train-iters 20 --log-interval 1
)
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
  return 0
fi
set -euo pipefail
cd "$LLAMA_STYLE_REPO"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m megatron_epp.training.launch --nproc-per-node "${NPROC:-2}" \
  --master-addr 127.0.0.1 --master-port "${MASTER_PORT:-$((29500 + RANDOM % 1000))}" \
  pretrain_gpt.py "${LLAMA_STYLE_ARGS[@]}" "$@"
