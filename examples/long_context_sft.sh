#!/usr/bin/env bash
# Long-context fine-tuning of a Qwen-style model on conversations, end to end with --elastic-pp: a Hugging Face
# checkpoint imported at TP x PP, fine-tuned on chat data at 4x its context (linear RoPE scaling) with the loss on the
# assistant's tokens only (--sft), exported back to a Hugging Face directory (its tokenizer and chat template beside it),
# and loaded by transformers.
#
#   bash examples/long_context_sft.sh     # on a CPU: a tiny random Qwen2 and its tokenizer made here (transformers, a
#                                         # test dependency), conversations asking what a Python source file defines
#
# On GPUs: your model, its tokenizer directory and your conversations (JSONL lines {"messages": [{"role", "content"}]}):
#   HF_DIR=Qwen2.5-7B-Instruct CHATS=chats.jsonl SEQ=131072 NPROC=8 TP=4 PP=1 BUDGET=70 bash examples/long_context_sft.sh \
#       --bf16 --train-iters 500 --lr 1e-5 --global-batch-size 64
# TP=4 PP=1 (data parallel 2) is what the planner's layout search chooses for Qwen2.5-7B at 128K tokens on one
# 8 x H100-80GB node (--epp-search-layout --epp-cluster h100-ib-node, mock lengths, 2026-11-29: 44.8 s a step predicted,
# TP2 x CP2 x DP2 1.02x slower); run pretrain_gpt.py with the flags below, --data-path PREFIX --epp-search-layout and
# WORLD_SIZE=8 to have it choose for your conversations' lengths. Megatron-LM's names: a Qwen2.5 model brings
# --add-qkv-bias, a Qwen3 --qk-layernorm (the import's flag line says so).
#
# Extra flags go to pretrain_gpt.py (the last one given wins). WORK (default: a new temporary directory) receives
# tiny-qwen/ (the made-up model), chats.jsonl and chats_text_document* (the prepared data), ckpt/ (the import),
# ckpt-long/ (the run) and hf-long/ (the export).
EXAMPLE_PORT=29512
# shellcheck source=examples/hf_import.sh
source "$(dirname "${BASH_SOURCE[0]}")/hf_import.sh"
BUDGET=${BUDGET:-0.0055}  # GB per device for activations and model states: tiny on a CPU, so that long conversations split
if [[ -z "${HF_DIR:-}" ]]; then
  HF_DIR=$WORK/tiny-qwen
  CHATS=${CHATS:-$WORK/chats.jsonl}
  "$PYTHON" - "$HF_DIR" "$CHATS" <<'PY'
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

hf_dir, chats = Path(sys.argv[1]), Path(sys.argv[2])
# conversations: a user pastes (part of) a Python standard-library module and asks what it defines; the assistant
# answers with the names of its top-level functions and classes. Long documents, short questions and answers.
rng = random.Random(0)
sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:120]
conversations = []
for path in sources:
    text = path.read_text(errors="replace")[: rng.choice([150, 300, 600, 1000, 1300])]
    names = re.findall(r"^(?:def|class) +(\w+)", text, flags=re.MULTILINE)  # top level (the cut may end inside one)
    conversations.append([{"role": "system", "content": "You read Python code."},
                          {"role": "user", "content": f"{text}\nWhat does this define?"},
                          {"role": "assistant", "content": ", ".join(names) or "nothing"}])
chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
# a byte-level BPE of 512 ids trained on them, as a Qwen2 tokenizer (Qwen's pre-tokenizer: what transformers' AutoTokenizer
# builds for a qwen2 directory) with ChatML's special tokens and Qwen's chat template
special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator([m["content"] for c in conversations for m in c],
                        trainers.BpeTrainer(vocab_size=512, special_tokens=special, show_progress=False,
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
trained = json.loads(bpe.to_str())["model"]
fast = transformers.Qwen2Tokenizer(vocab=trained["vocab"], merges=[tuple(m) for m in trained["merges"]], unk_token=None,
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
fast.add_special_tokens({"additional_special_tokens": special[1:]})
fast.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
fast.save_pretrained(hf_dir)
torch.manual_seed(0)  # a tiny random Qwen2: biases on Q, K and V, tied embeddings (as small Qwen2.5 models), context 256
config = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, rope_theta=1000000.0)
transformers.Qwen2ForCausalLM(config).save_pretrained(hf_dir)
print(f"> a tiny random Qwen2 (GQA 4:2, QKV biases, tied, context 256) and its tokenizer in {hf_dir}; "
      f"{len(conversations)} conversations in {chats}")
PY
fi
: "${CHATS:?CHATS: the conversations (JSONL) to fine-tune on, with HF_DIR}"
hf_import
SEQ=${SEQ:-$((4 * CONTEXT))}
"$PYTHON" -m megatron_epp.data.prepare --sft --input "$CHATS" --output-prefix "$WORK/chats_text_document" --no-progress \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_DIR"
echo "> long-context fine-tuning: context $CONTEXT -> $SEQ tokens (RoPE positions interpolated x$((SEQ / CONTEXT))), loss on the assistant's tokens"
"$PYTHON" -m megatron_epp.training.launch --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" pretrain_gpt.py \
  "${FLAGS[@]}" --seq-length "$SEQ" --rotary-seq-len-interpolation-factor "$((SEQ / CONTEXT))" \
  --load "$WORK/ckpt" --finetune --save "$WORK/ckpt-long" --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --sft --data-path "$WORK/chats_text_document" --split 100,0,0 --elastic-pp --epp-memory-budget "$BUDGET" \
  --global-batch-size 8 --train-iters 10 --lr 3e-3 --log-interval 1 "$@"
"${TORCHRUN[@]}" -m megatron_epp.checkpoint.hf_convert export --load "$WORK/ckpt-long" --hf-dir "$WORK/hf-long"
"$PYTHON" - "$WORK/hf-long" "$CHATS" <<'PY'
import json
import sys

import torch
import transformers

from megatron_epp.data.conversations import ChatTemplate, ConversationEncoder
from megatron_epp.data.tokenizers import HFTokenizer

out = sys.argv[1]
model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
messages = json.loads(open(sys.argv[2]).readline())["messages"]
ids = transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(messages, return_dict=True)["input_ids"]
ours = ConversationEncoder(ChatTemplate.from_tokenizer(out), HFTokenizer.from_file(f"{out}/tokenizer.json")).encode(messages)
assert list(ours.ids) == list(ids), "the exported tokenizer renders the conversation as training did"
with torch.no_grad():
    losses = torch.nn.functional.cross_entropy(model(torch.tensor([ids])).logits[0, :-1], torch.tensor(ids[1:]), reduction="none")
mask = torch.from_numpy(ours.loss_mask[1:]).float()  # a label trains where its token is the assistant's
print(f"> transformers loads {out}: {type(model).__name__}, context {model.config.max_position_embeddings}, "
      f"rope {model.config.rope_parameters}; its chat template renders the first conversation as training did "
      f"({len(ids)} tokens): loss {float((losses * mask).sum() / mask.sum()):.4f} on its {int(mask.sum())} assistant tokens")
PY
