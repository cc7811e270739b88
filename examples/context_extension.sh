#!/usr/bin/env bash
# Extending a pretrained LLaMA's context with --elastic-pp: a Hugging Face checkpoint imported at TP x PP, trained at
# 4x its context (or SEQ) with its RoPE scaling, and exported back to a Hugging Face directory.
#
#   bash examples/context_extension.sh          # on a CPU: a tiny random LLaMA made with transformers (a test dependency)
#   HF_DIR=llama3.2-1b SEQ=32768 NPROC=8 TP=2 PP=4 BUDGET=60 bash examples/context_extension.sh \
#       --data-path my_corpus_text_document --bf16 --train-iters 1000 --lr 1e-5
#
# Extra flags go to pretrain_gpt.py (the last one given wins); without --data-path it trains on --mock-data.
# WORK (default: a new temporary directory) receives ckpt/ (the import), ckpt-long/ (the run) and hf-long/ (the export).
EXAMPLE_PORT=29511
# shellcheck source=examples/hf_import.sh
source "$(dirname "${BASH_SOURCE[0]}")/hf_import.sh"
BUDGET=${BUDGET:-0.002}  # GB per device for activations and model states: tiny on a CPU, so that long documents split
if [[ -z "${HF_DIR:-}" ]]; then
  HF_DIR=$WORK/tiny-llama
  "$PYTHON" - "$HF_DIR" <<'PY'
import sys

import torch
import transformers

torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16, "rope_theta": 500000.0})
transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1])
print(f"a tiny random LLaMA (GQA 4:2, llama3 RoPE scaling, context 64) in {sys.argv[1]}")
PY
fi
hf_import
SEQ=${SEQ:-$((4 * CONTEXT))}
DATA=(--mock-data)
[[ " $* " == *" --data-path "* ]] && DATA=()
echo "> context extension: $CONTEXT -> $SEQ tokens"
"$PYTHON" -m megatron_epp.training.launch --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" pretrain_gpt.py \
  "${FLAGS[@]}" --seq-length "$SEQ" --load "$WORK/ckpt" --finetune --save "$WORK/ckpt-long" \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --elastic-pp --epp-memory-budget "$BUDGET" \
  "${DATA[@]}" --global-batch-size 8 --train-iters 10 --lr 3e-3 --log-interval 1 "$@"
"${TORCHRUN[@]}" -m megatron_epp.checkpoint.hf_convert export --load "$WORK/ckpt-long" --hf-dir "$WORK/hf-long"
"$PYTHON" -c "import sys, transformers; m = transformers.LlamaForCausalLM.from_pretrained(sys.argv[1]); \
print(f'> transformers loads {sys.argv[1]}: context {m.config.max_position_embeddings}, rope {m.config.rope_parameters}')" "$WORK/hf-long"
