# shellcheck shell=bash disable=SC2034  # sourced: MAIN_JOB_ARGS is read by the caller
# The main job's pretrain_gpt.py flags, sourced by scripts/train_default.sh and scripts/slurm/train.sbatch:
# a byte-level GPT trained with --elastic-pp at pp=2 on the Python standard library's sources (one
# document per file, built and cached in data_cache/stdlib on first use). Sets MAIN_JOB_ARGS.
MAIN_JOB_DATA=$("${PYTHON:-python3}" -m megatron_epp.data.stdlib_corpus | tail -n 1)
MAIN_JOB_ARGS=(
  --data-path "$MAIN_JOB_DATA" --tokenizer-type ByteTokenizer
  --pipeline-model-parallel-size 2
  --num-layers 4 --hidden-size 128 --num-attention-heads 4
  --elastic-pp --seq-length 2048 --epp-truncate-documents --global-batch-size 8
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 5 --lr-decay-style cosine --clip-grad 1.0
  --train-iters 40 --log-interval 5 --eval-interval 20 --eval-iters 1
)
