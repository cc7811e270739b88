# shellcheck shell=bash disable=SC2034  # sourced: MAIN_JOB_ARGS is read by the caller
# The main job's pretrain_gpt.py flags, sourced by scripts/train_default.sh and scripts/slurm/train.sbatch:
# a byte-level GPT trained with --elastic-pp at pp=2 on the Python standard library's sources (one
# document per file, built and cached in data_cache/stdlib on first use). Sets MAIN_JOB_ARGS.
# Chosen so that the plans show what EPP does: at cap 4096, 8 documents per step mix short files (packed
# whole: batched chunks) with long ones (split, and their tails packed with short files: hybrid chunks), and a
# memory budget of 0.03 GB per stage binds as device memory does at long context, so that EPP's own plan is
# predicted faster than Megatron packing's and Seq1F1B's (each log line gives both ratios; checked by
# tests/unit/test_main_job.py). The
# model (2 layers, hidden 64, 4 heads: the shape of the shipped CPU profile test-model) keeps the run as short
# as the earlier default (4 layers, hidden 128, cap 2048, no budget), whose plans were mostly Seq1F1B's.
MAIN_JOB_DATA=$("${PYTHON:-python3}" -m megatron_epp.data.stdlib_corpus | tail -n 1)
MAIN_JOB_ARGS=(
  --data-path "$MAIN_JOB_DATA" --tokenizer-type ByteTokenizer
  --pipeline-model-parallel-size 2
  --num-layers 2 --hidden-size 64 --num-attention-heads 4
  --elastic-pp --seq-length 4096 --epp-truncate-documents --global-batch-size 8 --epp-memory-budget 0.03
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 5 --lr-decay-style cosine --clip-grad 1.0
  --train-iters 40 --log-interval 5 --eval-interval 20 --eval-iters 1
)
