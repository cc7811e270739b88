#!/bin/bash
# LLaMA-3-8B in the layout and flags of Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh, with
# --elastic-pp added: the same variable blocks (GPT_MODEL_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS, DATA_ARGS,
# EVAL_AND_LOGGING_ARGS) and positional arguments; what differs from upstream is said where it is.
#
#   bash examples/train_llama3_8b.sh [CHECKPOINT_PATH] [TENSORBOARD_LOGS_PATH] [TOKENIZER_ARG|MOCK] [DATA_ARG|MOCK]
#   SIZE=toy bash examples/train_llama3_8b.sh /tmp/ckpt /tmp/tb   # the same flags on a toy model: CPU, 2 ranks
#   NUM_NODES=4 NODE_RANK=... MASTER_ADDR=... SIZE=8b-128k bash examples/train_llama3_8b.sh   # 128K documents, CP 4
#
# SIZE=8b (default): 8 GPUs per node, tp 2 x pp 4. SIZE=8b-128k: documents up to 128K tokens (--seq-length 131072),
# 4 nodes of 8 GPUs, tp 2 x cp 4 x pp 4 (context parallelism, Ulysses all-to-all: each chunk's tokens split over
# the 4 CP ranks of a stage, attention on every token for heads / 4), as Megatron-LM's long-context recipes set
# --context-parallel-size. SIZE=toy: a 4-layer model of the same shape (GQA 4:2, SwiGLU, untied, no biases, RoPE
# base 1e6), pp 2 over 2 CPU ranks (gloo), 6 iterations of 8 documents; CP_SIZE=2 PP_SIZE=1 runs it at cp 2
# (2 ranks; the ranks are CP_SIZE x PP_SIZE).
# Extra arguments after the four positional ones go to pretrain_gpt.py (the last one given wins).

# Environment variables for performance tuning
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

CHECKPOINT_PATH=${1:-"checkpoints/llama3_8b"}
TENSORBOARD_LOGS_PATH=${2:-"tensorboard_logs/llama3_8b"}
TOKENIZER_ARG=${3:-"MOCK"} # Path to tokenizer model, or "MOCK"
DATA_ARG=${4:-"MOCK"}     # Data prefix, or "MOCK"
shift $(( $# < 4 ? $# : 4 ))
SIZE=${SIZE:-8b}

# Create directories if they don't exist (upstream creates the parent of CHECKPOINT_PATH; the directory itself is
# created too, so that the first run's --load finds an empty directory and starts from scratch)
mkdir -p "$CHECKPOINT_PATH"
mkdir -p "$(dirname "$TENSORBOARD_LOGS_PATH")"

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PRETRAIN_SCRIPT_PATH="$REPO/pretrain_gpt.py"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# Fixed model and training parameters
case "$SIZE" in
  8b)
    GPUS_PER_NODE=${GPUS_PER_NODE:-8}
    TP_SIZE=2; CP_SIZE=1; PP_SIZE=4  # upstream: tp 1, no pp (EPP plans over pipeline stages)
    GLOBAL_BATCH_SIZE=128
    NUM_LAYERS=32; HIDDEN_SIZE=4096; FFN_HIDDEN_SIZE=14336; NUM_HEADS=32; NUM_QUERY_GROUPS=8; KV_CHANNELS=128
    SEQ_LENGTH=8192
    VOCAB_SIZE=128256
    TRAIN_SAMPLES=1953125000; LR_DECAY_SAMPLES=1949218748; LR_WARMUP_SAMPLES=3906252
    EVAL_ITERS=32; EVAL_INTERVAL=100; SAVE_INTERVAL=1000
    ;;
  8b-128k)
    GPUS_PER_NODE=${GPUS_PER_NODE:-8}
    TP_SIZE=2; CP_SIZE=4; PP_SIZE=4  # 32 GPUs: world = tp x cp x pp x dp
    GLOBAL_BATCH_SIZE=8  # documents of up to 128K tokens: about 1M tokens a step, as SIZE=8b's 128 x 8K
    NUM_LAYERS=32; HIDDEN_SIZE=4096; FFN_HIDDEN_SIZE=14336; NUM_HEADS=32; NUM_QUERY_GROUPS=8; KV_CHANNELS=128
    SEQ_LENGTH=131072
    VOCAB_SIZE=128256
    TRAIN_SAMPLES=122070312; LR_DECAY_SAMPLES=121826170; LR_WARMUP_SAMPLES=244141
    EVAL_ITERS=32; EVAL_INTERVAL=100; SAVE_INTERVAL=1000
    ;;
  toy)
    TP_SIZE=1; CP_SIZE=${CP_SIZE:-1}; PP_SIZE=${PP_SIZE:-2}
    GPUS_PER_NODE=${GPUS_PER_NODE:-$((CP_SIZE * PP_SIZE))}
    GLOBAL_BATCH_SIZE=8
    NUM_LAYERS=4; HIDDEN_SIZE=64; FFN_HIDDEN_SIZE=176; NUM_HEADS=4; NUM_QUERY_GROUPS=2; KV_CHANNELS=16
    SEQ_LENGTH=256
    VOCAB_SIZE=1000
    TRAIN_SAMPLES=48; LR_DECAY_SAMPLES=40; LR_WARMUP_SAMPLES=8
    EVAL_ITERS=1; EVAL_INTERVAL=3; SAVE_INTERVAL=3
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    ;;
  *) echo "SIZE=$SIZE: 8b, 8b-128k or toy" >&2; exit 2 ;;
esac
MICRO_BATCH_SIZE=1  # with --elastic-pp chunks replace micro-batches (pretrain_gpt.py says so at start-up)
MAX_POSITION_EMBEDDINGS=$SEQ_LENGTH
DTYPE=${DTYPE:-bf16}

# Data cache path (useful for both mock and real data)
DATA_CACHE_PATH="${PWD}/benchmark_cache_llama3_8b"
mkdir -p "$DATA_CACHE_PATH"

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "${NUM_NODES:-1}"
    --node_rank "${NODE_RANK:-0}"
    --master_addr "${MASTER_ADDR:-localhost}"
    --master_port "${MASTER_PORT:-6000}"
)

GPT_MODEL_ARGS=(
    --use-mcore-models
    --num-layers "$NUM_LAYERS"
    --hidden-size "$HIDDEN_SIZE"
    --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-attention-heads "$NUM_HEADS"
    --group-query-attention
    --num-query-groups "$NUM_QUERY_GROUPS"
    --kv-channels "$KV_CHANNELS"
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$MAX_POSITION_EMBEDDINGS"
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH_SIZE"
    --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-samples "$TRAIN_SAMPLES"
    --lr-decay-samples "$LR_DECAY_SAMPLES"
    --lr-warmup-samples "$LR_WARMUP_SAMPLES"
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
    --elastic-pp  # added: whole documents per global batch, planned every step
)

# Upstream's DTYPE=fp8 block (--fp8-format hybrid, --fp8-amax-history-len 1024, --fp8-amax-compute-algo max,
# --fp8-param-gather) is refused by pretrain_gpt.py: fp8 needs Transformer Engine's layers, which are not used here.
if [[ "$DTYPE" == "fp8" ]]; then
    echo "DTYPE=fp8: not supported with megatron-epp (train in bf16)" >&2; exit 2
fi

# Model parallelism arguments
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP_SIZE"
    --context-parallel-size "$CP_SIZE"
    --pipeline-model-parallel-size "$PP_SIZE"
)
MODEL_PARALLEL_ARGS+=(--sequence-parallel)  # at tp 1 turned off with a start-up line, as Megatron-LM

# Distributed Data Parallel (DDP) arguments
DDP_ARGS=(
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)
TRAINING_ARGS+=("${DDP_ARGS[@]}")

# Data arguments (conditional for mock vs real data)
if [[ "$TOKENIZER_ARG" == "MOCK" ]] || [[ "$DATA_ARG" == "MOCK" ]] || [[ -z "$TOKENIZER_ARG" ]]; then
    DATA_ARGS=(
        --mock-data
        --tokenizer-type NullTokenizer
        --vocab-size "$VOCAB_SIZE"
        --data-cache-path "$DATA_CACHE_PATH"
        --tiktoken-pattern v2
        --split 99,1,0
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
    )
else
    DATA_ARGS=(
        --data-path "$DATA_ARG"
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "$TOKENIZER_ARG"
        --data-cache-path "$DATA_CACHE_PATH"
        --split 99,1,0
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
        --vocab-size "$VOCAB_SIZE"
    )
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-iters "$EVAL_ITERS"
    --eval-interval "$EVAL_INTERVAL"
    --save-interval "$SAVE_INTERVAL"
    --log-throughput
    --profile
    --profile-step-start 4
    --profile-step-end 6
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --ckpt-format torch_dist
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)
# --profile: iterations 4 and 5 of rank 0 between cudaProfilerStart and cudaProfilerStop, for
# `nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop` (on CPU nothing to capture: a start-up line
# says so); add --use-pytorch-profiler for a torch.profiler trace under TENSORBOARD_LOGS_PATH instead

# Run the training command (upstream: torchrun; megatron_epp.training.launch takes torchrun's options and makes a
# SIGTERM to the launcher or the ranks save and exit 0, see README "Checkpoints and resume")
exec "${PYTHON:-python3}" -m megatron_epp.training.launch "${DISTRIBUTED_ARGS[@]}" \
    "$PRETRAIN_SCRIPT_PATH" \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "$@"
