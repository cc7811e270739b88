"""Hugging Face LLaMA in and out (``megatron_epp.checkpoint.hf_convert``), against ``transformers`` itself.

A tiny random LLaMA (GQA 4:2, untied embeddings, ``rope_theta`` 500000, ``llama3`` RoPE scaling with its own
low/high frequency factors and an original context of 16, not megatron-core's fixed 1/4/8192) is saved by
``transformers`` in shards, and a tied one with the older ``rope_theta`` + ``rope_scaling`` form of config.json; one
2-rank launch imports the first at TP 2 and the second at PP 2, and megatron-epp's logits on five documents equal
``transformers``' forward, on the stock path and with ``--elastic-pp`` (split, hybrid and batched chunks); so does the
loss of a training step. A K/V swap planted in the import and a RoPE scaling factor off go red. Import -> export gives
``transformers`` the original tensors (also exported at another layout than the import's); a run trained two steps exports to a model with that run's logits. Last, ``pretrain_gpt.py`` with
the flag line the import prints continues training the imported model with ``--elastic-pp`` at 4x its context (the
RoPE scaling on), loss falling, plans with split chunks, at pp 1 x cp 2 (the PP 2 import resharded, context parallelism).
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_epp.checkpoint.hf_convert import flag_line  # noqa: E402
from megatron_epp.checkpoint.hf_llama import read_spec  # noqa: E402
from megatron_epp.training.metrics import read_metrics  # noqa: E402
from tests.launch import torchrun  # noqa: E402

LENGTHS = [41, 10, 31, 6, 13]  # documents (tokens + 1: each predicts its next tokens)
# fp32: measured 2e-7 at most on the logits and the loss (2026-11-27); the planted RoPE factor moves the logits by 3e-3
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny_llama(path, tied=False) -> torch.nn.Module:
    torch.manual_seed(int(tied))
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 6.0,
                      "original_max_position_embeddings": 16, "rope_theta": 500000.0})
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, max_shard_size="150KB")
    return model


def hf_reference(model, docs):
    with torch.no_grad():
        logits = [model(d[None, :-1]).logits[0].float() for d in docs]
    loss = torch.nn.functional.cross_entropy(torch.cat(logits), torch.cat([d[1:] for d in docs]))
    return logits, float(loss)


def close(result, logits, loss) -> bool:
    return all(torch.allclose(a, b, **TOL) for a, b in zip(result["logits"], logits)) and abs(result["loss"] - loss) < 1e-5


def test_hf_llama_import_export(tmp_path):
    hf = tmp_path / "hf"
    model = tiny_llama(hf)
    assert (hf / "model.safetensors.index.json").exists()  # sharded
    legacy = tmp_path / "hf_legacy"  # tied embeddings, and the LLaMA 3.x form of config.json: rope_theta + rope_scaling
    tied = tiny_llama(legacy, tied=True)
    config = json.loads((legacy / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (legacy / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in LENGTHS]
    torch.save(docs, tmp_path / "docs.pt")
    logits, loss = hf_reference(model, docs)
    tied_logits, tied_loss = hf_reference(tied, docs)

    t = str(tmp_path)
    flags = shlex.split(flag_line(read_spec(str(legacy)), str(legacy), 1))[1:]  # what the import of the PP 2 checkpoint prints
    extension = [*flags, "--seq-length", str(4 * 64), "--load", f"{t}/pp2", "--finetune", "--elastic-pp", "--pipeline-model-parallel-size", "1",
                 "--context-parallel-size", "2",
                 "--mock-data", "--global-batch-size", "8", "--train-iters", "10", "--lr", "3e-3", "--log-interval", "1",
                 "--epp-memory-budget", "0.002", "--epp-metrics", f"{t}/extension.jsonl"]
    runs = [
        ["import", f"{t}/hf", f"{t}/tp2", "2", "1"], ["logits", f"{t}/tp2", f"{t}/docs.pt", f"{t}/tp2_stock.pt", "2", "1"],
        ["logits", f"{t}/tp2", f"{t}/docs.pt", f"{t}/tp2_elastic.pt", "2", "1", "--elastic"],
        ["logits", f"{t}/tp2", f"{t}/docs.pt", f"{t}/fault_rope.pt", "2", "1", "--elastic", "--fault", "rope_factor"],
        ["import", f"{t}/hf", f"{t}/bad", "2", "1", "--fault", "qkv_swapped"],
        ["logits", f"{t}/bad", f"{t}/docs.pt", f"{t}/fault_qkv.pt", "2", "1"],
        ["import", f"{t}/hf_legacy", f"{t}/pp2", "1", "2"], ["logits", f"{t}/pp2", f"{t}/docs.pt", f"{t}/pp2_stock.pt", "1", "2"],
        ["logits", f"{t}/pp2", f"{t}/docs.pt", f"{t}/pp2_elastic.pt", "1", "2", "--elastic"],
        ["export", f"{t}/pp2", f"{t}/hf_out"], ["export", f"{t}/tp2", f"{t}/hf_tp2_at_pp2", "1", "2"],
        ["logits", f"{t}/pp2", f"{t}/docs.pt", f"{t}/trained.pt", "1", "2", "--elastic", "--train-steps", "2", "--save-trained", f"{t}/trained"],
        ["export", f"{t}/trained", f"{t}/hf_trained"],
        ["pretrain", *extension],
    ]
    argv = [a for run in runs for a in ["::", *run]][1:]
    torchrun(2, "tests/workers/hf_llama.py", *argv, timeout=600)

    for name, want, want_loss in (("tp2_stock", logits, loss), ("tp2_elastic", logits, loss), ("pp2_stock", tied_logits, tied_loss),
                                  ("pp2_elastic", tied_logits, tied_loss)):
        result = torch.load(tmp_path / f"{name}.pt")
        assert close(result, want, want_loss), (name, max(float((a - b).abs().max()) for a, b in zip(result["logits"], want)), result["loss"])
    for fault in ("fault_rope", "fault_qkv"):  # the planted faults go red
        assert not close(torch.load(tmp_path / f"{fault}.pt"), logits, loss), fault

    # context extension: the imported model trains at 4x its context (RoPE scaled) at pp 1 x cp 2, loss falling, plans with split chunks
    train = [m for m in read_metrics(tmp_path / "extension.jsonl") if m.kind == "train"]
    assert [m.iteration for m in train] == list(range(1, 11))
    assert sum(m.loss for m in train[-3:]) / 3 < 0.95 * train[0].loss, [m.loss for m in train]
    assert any(m.elastic.num_chunks["split"] for m in train)

    # import -> export: transformers loads the original tensors (the tied model at pp 2; the TP 2 import exported at pp 2)
    for out, source in (("hf_out", tied), ("hf_tp2_at_pp2", model)):
        exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / out).eval()
        original = source.state_dict()
        assert exported.state_dict().keys() == original.keys() and exported.config.tie_word_embeddings == source.config.tie_word_embeddings
        for key, value in exported.state_dict().items():
            assert torch.equal(value, original[key]), (out, key)
        assert exported.config.rope_parameters == source.config.rope_parameters

    trained = torch.load(tmp_path / "trained.pt")
    assert abs(trained["loss"] - tied_loss) < 1e-5  # the first step's loss, before the two updates
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_trained").eval()
    after, _ = hf_reference(exported, docs)
    assert not torch.allclose(after[0], tied_logits[0], **TOL)  # it trained
    for a, b in zip(trained["logits"], after):
        torch.testing.assert_close(a, b, **TOL)
