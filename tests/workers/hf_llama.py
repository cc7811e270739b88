"""Hugging Face LLaMA-family import/export runs in one launch (``::`` between runs, as tests/workers/elastic_equivalence.py).

    import HF_DIR SAVE TP PP [--fault F]               hf_convert import at TP x PP; a fault (IMPORT_FAULTS) in linear_qkv:
                                                       K and V swapped, each group's query heads transposed, the QKV bias dropped
    export SAVE HF_OUT [TP PP] [FLAGS]                 hf_convert export at the checkpoint's layout (or TP x PP), export's flags
    logits SAVE DOCS OUT TP PP [--elastic] [--fault rope_factor] [--train-steps N --save-trained DIR]
        the checkpoint's logits on the documents of DOCS (a list of token tensors; each predicts its own next tokens)
        and the loss of a training step on them (forward and backward): the stock path, each document a micro-batch,
        or --elastic through a plan of split, hybrid and batched chunks (pp stages); saved by the last stage as OUT.
        --train-steps: that many SGD steps first (the step's loss is the first's), then saved as DIR (model only)
        and the logits are the trained model's. --fault rope_factor: --rope-scaling-factor halved; --fault qk_norm_skipped:
        the query and key norms not applied.
    pretrain FLAGS...                                  pretrain_gpt.py's main with these flags (the launch's last run)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import unwrap_model

from megatron_epp.executor.batches import chunk_batches, per_token_loss
from megatron_epp.executor.context import ChunkContext
from megatron_epp.executor.schedule import forward_backward_elastic
from megatron_epp.plan import Chunk, Pipeline, Plan, Segment, chunk_kind
from megatron_epp.checkpoint import records, store
from megatron_epp.checkpoint import hf_convert
from megatron_epp.checkpoint import hf_llama
from megatron_epp.config.parser import parse_config
from megatron_epp.training.gpt_step import reduce_losses
from megatron_epp.model.runtime import initialize, shutdown
from megatron_epp.training.loop import build_optimizer
from megatron_epp.model.gpt import build_model
from tests.workers.runs import split_runs


def elastic_plan(lengths: list[int], stages: int, layers: int) -> Plan:
    """Documents 0 and 2 split (0's last slice packed with document 3: hybrid), 1 and 4 batched."""
    a, c = lengths[0], lengths[2]
    chunks = [[Segment(0, 0, a // 3)], [Segment(0, a // 3, 2 * a // 3)], [Segment(0, 2 * a // 3, a), Segment(3, 0, lengths[3])],
              [Segment(1, 0, lengths[1]), Segment(4, 0, lengths[4])], [Segment(2, 0, c // 2)], [Segment(2, c // 2, c)]]
    pipe = Pipeline([Chunk(i, chunk_kind(s, lengths), s) for i, s in enumerate(chunks)], [[0] * len(chunks) for _ in range(stages)])
    return Plan(lengths, stages, [layers // stages] * stages, [pipe], builder="test").validate()


def _per_group(spec, t: torch.Tensor):
    """``linear_qkv``'s weight or bias as [groups, (per + 2) * d, ...] and the group's query heads' width."""
    d, per = spec.head_dim, spec.num_heads // spec.num_kv_heads
    return t.reshape(-1, (per + 2) * d, *t.shape[1:]), per * d


def swap_kv(spec, t):  # per group [q; k; v] -> [q; v; k]
    g, q = _per_group(spec, t)
    d = spec.head_dim
    return torch.cat([g[:, :q], g[:, q + d :], g[:, q : q + d]], 1).reshape(t.shape)


def transpose_heads(spec, t):  # each group's query heads in reverse order
    g, q = _per_group(spec, t)
    d = spec.head_dim
    heads = g[:, :q].reshape(g.shape[0], q // d, d, *g.shape[2:]).flip(1).reshape(g.shape[0], q, *g.shape[2:])
    return torch.cat([heads, g[:, q:]], 1).reshape(t.shape)


# import faults: what each does to megatron-core's linear_qkv weight or bias as it is read
IMPORT_FAULTS = {
    "qkv_swapped": ("linear_qkv.weight", swap_kv),
    "heads_transposed": ("linear_qkv.weight", transpose_heads),
    "qkv_bias_dropped": ("linear_qkv.bias", lambda spec, t: torch.zeros_like(t)),
}


def faulty(original, fault):
    suffix, change = IMPORT_FAULTS[fault]

    def read(reader, spec, name, layer, tp, tp_rank, padded):
        t = original(reader, spec, name, layer, tp, tp_rank, padded)
        return change(spec, t) if name.endswith(suffix) else t
    return read


def run_import(argv: list[str]) -> None:
    hf_dir, save, tp, pp, *rest = argv
    original = hf_convert.megatron_tensor
    if rest[:1] == ["--fault"]:
        hf_convert.megatron_tensor = faulty(original, rest[1])
    try:
        hf_convert.import_checkpoint(hf_convert._parser().parse_args(
            ["import", "--hf-dir", hf_dir, "--save", save, "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp]))
    finally:
        hf_convert.megatron_tensor = original


def run_export(argv: list[str]) -> None:
    save, out, *rest = argv  # [TP PP]: another layout than the checkpoint's; then export's own flags (--bf16, --model-type ...)
    layout = rest[:2] if rest[:1] and not rest[0].startswith("--") else []
    flags = ["--tensor-model-parallel-size", layout[0], "--pipeline-model-parallel-size", layout[1]] if layout else []
    hf_convert.export_checkpoint(hf_convert._parser().parse_args(["export", "--load", save, "--hf-dir", out, *flags, *rest[len(layout):]]))


def _step(model, docs, plan, elastic, forward_only, capture, runtime, config):
    """One forward (and backward) over the documents; ``capture``: the last stage's logits per (doc, position range)."""
    def forward(data_iterator, model_):
        batch = next(data_iterator)
        positions = ChunkContext.of(model_).view().position_ids[None] if elastic else batch["position_ids"]
        output = model_(batch.get("tokens"), positions, None, labels=None if forward_only else batch.get("labels"))
        segments = batch.get("segments")

        def loss(output_tensor):
            if forward_only:
                capture.append((segments, output_tensor.detach()))
                return output_tensor.sum() * 0, torch.tensor(1), {}
            return per_token_loss(batch["loss_mask"], output_tensor)
        return output, loss

    if elastic:
        batches = [dict(b, segments=c.segments) for c, b in zip(plan.chunks(), chunk_batches(plan, [(d[:-1], d[1:]) for d in docs], runtime.device))]
        return forward_backward_elastic(forward_step_func=forward, data_iterator=iter(batches), model=[model],
                                        num_microbatches=len(batches), plan=plan, forward_only=forward_only)
    # the stock schedule sends [seq_length, 1, hidden] between stages: every document padded at its end to the longest
    # (causal attention: the padding changes no earlier logit; its loss mask is 0)
    width = max(len(d) for d in docs) - 1
    batches = []
    for i, d in enumerate(docs):
        pad = torch.zeros(width - (len(d) - 1), dtype=d.dtype)
        mask = torch.cat([torch.ones(len(d) - 1), torch.zeros(len(pad))])
        batches.append({"tokens": torch.cat([d[:-1], pad])[None], "labels": torch.cat([d[1:], pad])[None], "loss_mask": mask[None],
                        "position_ids": torch.arange(width)[None], "segments": [Segment(i, 0, len(d) - 1)]})
    return get_forward_backward_func()(forward_step_func=forward, data_iterator=iter(batches), model=[model], num_microbatches=len(batches),
                                       seq_length=width, micro_batch_size=1, forward_only=forward_only)


def run_logits(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("save")
    p.add_argument("docs")
    p.add_argument("out")
    p.add_argument("tp")
    p.add_argument("pp")
    p.add_argument("--elastic", action="store_true")
    p.add_argument("--fault", default=None)
    p.add_argument("--train-steps", type=int, default=0)
    p.add_argument("--save-trained", default=None)
    a = p.parse_args(argv)
    with open(os.path.join(records.iteration_dir(a.save, 0), records.METADATA)) as f:
        record = json.load(f)["model"]
    flags = hf_llama.flags_from_record(record) + ["--mock-data", "--load", a.save, "--finetune", "--tensor-model-parallel-size", a.tp,
                                                  "--pipeline-model-parallel-size", a.pp, "--lr", "0.05", "--optimizer", "sgd"]
    if a.save_trained:
        flags += ["--save", a.save_trained]
    cfg = parse_config(flags + (["--elastic-pp"] if a.elastic else []))
    if a.fault == "rope_factor":
        cfg = cfg.replace(model={"rope_scaling_factor": cfg.model.rope_scaling_factor / 2})
    runtime = initialize(cfg)
    model, config = build_model(cfg, runtime, context=ChunkContext() if a.elastic else None)
    store.load_model_weights(cfg, 0, model, runtime)
    if a.fault == "qk_norm_skipped":  # the query and key norms loaded, then not applied
        for layer in unwrap_model(model).decoder.layers:
            layer.self_attention.q_layernorm = layer.self_attention.k_layernorm = torch.nn.Identity()
    optimizer, _ = build_optimizer(cfg, model, config)
    optimizer.reload_model_params()
    docs = torch.load(a.docs)
    plan = elastic_plan([len(d) - 1 for d in docs], runtime.dims.pp, cfg.model.num_layers)
    loss = None
    for step in range(max(1, a.train_steps)):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        step_loss = reduce_losses(_step(model, docs, plan, a.elastic, False, None, runtime, config), ps.get_data_parallel_group())
        loss = step_loss if loss is None else loss
        if a.train_steps:
            optimizer.step()
    if a.save_trained:
        store.save_checkpoint(cfg, model, None, None, runtime, a.train_steps, 0)
    capture: list = []
    with torch.no_grad():
        _step(model, docs, plan, a.elastic, True, capture, runtime, config)
    if runtime.is_last_stage:
        logits = [torch.zeros(len(d) - 1, cfg.model.vocab_size) for d in docs]
        for segments, out in capture:
            if runtime.dims.tp > 1:  # vocabulary-parallel logits: gathered
                parts = [torch.empty_like(out) for _ in range(runtime.dims.tp)]
                dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
                out = torch.cat(parts, -1)
            rows = out.reshape(-1, out.shape[-1])  # [1, tokens, vocab]: a chunk, or a padded document
            at = 0
            for s in segments:
                logits[s.seq][s.start : s.end] = rows[at : at + s.end - s.start, : cfg.model.vocab_size]
                at += s.end - s.start
        if runtime.tp_rank == 0 and runtime.dp_rank == 0:
            torch.save({"logits": logits, "loss": loss}, a.out)
    dist.barrier()


def run_pretrain(argv: list[str]) -> None:
    from megatron_epp.training.main import main as pretrain

    if pretrain(parse_config(argv)) != 0:
        raise SystemExit("pretrain_gpt.py failed")


def main() -> None:
    for i, argv in enumerate(split_runs(sys.argv[1:])):
        if i:
            ps.destroy_model_parallel()
        {"import": run_import, "export": run_export, "logits": run_logits, "pretrain": run_pretrain}[argv[0]](argv[1:])
    shutdown()


if __name__ == "__main__":
    sys.exit(main())
