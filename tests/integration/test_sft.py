"""Conversations with the loss on the assistant's tokens (``--sft``), against ``transformers`` itself.

Conversations are prepared with ``epp-prepare-data --sft`` (a tiny tokenizer with ChatML's template, built in the test)
and a tiny random LLaMA of the tokenizer's vocabulary is imported at PP 2. One 2-rank launch computes the first step's
loss with ``--elastic-pp``'s own path (sampler -> labels' masks -> chunk batches of a plan with split, hybrid and
batched chunks -> elastic schedule -> per-token loss) at pp 2 and at pp 1 x cp 2: it equals transformers' cross-entropy
over the assistant's tokens (``apply_chat_template(..., return_assistant_tokens_mask=True)`` on the same conversations:
the sum over masked labels / their count). The masks left out, or each label given its own token's mask instead of
the next one's, go red. Last, ``pretrain_gpt.py --sft --elastic-pp`` trains the imported model on the dataset, its
first logged loss that of transformers on the same first global batch.
"""

from __future__ import annotations

import shlex

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_epp.checkpoint.hf_convert import flag_line  # noqa: E402
from megatron_epp.checkpoint.hf_llama import read_spec  # noqa: E402
from megatron_epp.data import prepare as prepare_data  # noqa: E402
from megatron_epp.data.documents import DocumentDataset  # noqa: E402
from megatron_epp.data.sequence_sampler import SequenceSampler  # noqa: E402
from megatron_epp.training.metrics import read_metrics  # noqa: E402
from tests.chat import CHATML, CONVERSATIONS, TOOL_CONVERSATION, VOCAB_SIZE, write_chat_tokenizer, write_jsonl  # noqa: E402
from tests.launch import torchrun  # noqa: E402

CHATS = CONVERSATIONS + [TOOL_CONVERSATION, CONVERSATIONS[0][:3]]  # five: elastic_plan's documents
TOL = 1e-5  # fp32


def tiny_llama(path) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   initializer_range=0.2)  # logits far from uniform: a wrong mask moves the loss
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def masked_loss(model, tokenizer, conversations, shift: bool = False) -> float:
    """transformers' cross-entropy over the assistant's labels of ``conversations`` (sum / count); ``shift``: each label
    masked by its own input token's mask (the planted fault's loss)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for conversation in conversations:
            out = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = torch.tensor(out["input_ids"]), torch.tensor(out["assistant_masks"], dtype=torch.float64)
            logits = model(ids[None, :-1]).logits[0].double()
            losses = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
            m = mask[:-1] if shift else mask[1:]
            total += float((losses * m).sum())
            count += int(m.sum())
    return total / count


def test_sft_loss_equals_transformers(tmp_path):
    hf = tmp_path / "hf"
    model = tiny_llama(hf)
    write_chat_tokenizer(hf, CHATML)  # the model's tokenizer and template beside its weights
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf))
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf), "--no-progress"]
    assert prepare_data.main(["--sft", "--input", str(write_jsonl(tmp_path / "five.jsonl", CHATS)), "--output-prefix",
                              str(tmp_path / "five"), *tok]) == 0
    assert prepare_data.main(["--sft", "--input", str(write_jsonl(tmp_path / "chats.jsonl", CHATS * 8)), "--output-prefix",
                              str(tmp_path / "chats"), *tok]) == 0
    want = masked_loss(model, tokenizer, CHATS)

    t = str(tmp_path)
    flags = shlex.split(flag_line(read_spec(str(hf)), str(hf), 1))[1:]
    pretrain = [*flags, "--load", f"{t}/pp2", "--finetune", "--elastic-pp", "--sft", "--data-path", f"{t}/chats", "--split", "1,0,0",
                "--pipeline-model-parallel-size", "2", "--seq-length", "128", "--global-batch-size", "8", "--train-iters", "3",
                "--lr", "1e-3", "--log-interval", "1", "--epp-metrics", f"{t}/sft.jsonl"]
    runs = [
        ["import", str(hf), f"{t}/pp2", "1", "2"],
        ["loss", str(hf), f"{t}/pp2", f"{t}/five", f"{t}/pp2.pt", "2", "1"],
        ["loss", str(hf), f"{t}/pp2", f"{t}/five", f"{t}/cp2.pt", "1", "2"],
        ["loss", str(hf), f"{t}/pp2", f"{t}/five", f"{t}/ignore.pt", "2", "1", "--fault", "ignore"],
        ["loss", str(hf), f"{t}/pp2", f"{t}/five", f"{t}/shift.pt", "2", "1", "--fault", "shift"],
        ["pretrain", *pretrain],
    ]
    torchrun(2, "tests/workers/sft.py", *[a for run in runs for a in ["::", *run]][1:], timeout=600)

    for name in ("pp2", "cp2"):
        result = torch.load(tmp_path / f"{name}.pt")
        assert sorted(result["doc_indices"]) == list(range(len(CHATS)))
        assert all(result["chunks"][kind] for kind in ("batched", "split", "hybrid")), result["chunks"]
        assert abs(result["loss"] - want) < TOL, (name, result["loss"], want)
    for fault in ("ignore", "shift"):  # the planted faults go red
        assert abs(torch.load(tmp_path / f"{fault}.pt")["loss"] - want) > 1e3 * TOL, fault
    assert abs(torch.load(tmp_path / "shift.pt")["loss"] - masked_loss(model, tokenizer, CHATS, shift=True)) < TOL  # what it planted

    # pretrain_gpt.py --sft: the first step's loss is transformers' on the first global batch's conversations
    train = [m for m in read_metrics(tmp_path / "sft.jsonl") if m.kind == "train"]
    assert [m.iteration for m in train] == [1, 2, 3] and all(np.isfinite(m.loss) for m in train)
    assert all(m.elastic is not None and sum(m.elastic.num_chunks.values()) for m in train)
    first = next(SequenceSampler(DocumentDataset(f"{t}/chats"), 8, 128).iterate()).doc_indices
    all_chats = CHATS * 8
    assert abs(train[0].loss - masked_loss(model, tokenizer, [all_chats[i] for i in first])) < TOL, train[0].loss
