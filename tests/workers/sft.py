"""Conversations with their loss masks (``--sft``) in one launch (``::`` between runs, as tests/workers/hf_llama.py).

    import HF_DIR SAVE TP PP                          hf_convert import (tests/workers/hf_llama.py's run)
    loss HF_DIR SAVE PREFIX OUT PP CP [--fault ignore|shift]
        the first step's loss (forward and backward, no update) of the checkpoint on the five conversations of the
        dataset PREFIX (with its loss masks) as the --elastic-pp path builds it: the sampler's sequences with their
        labels' masks, prepare_step's chunk batches of a plan of split, hybrid and batched chunks
        (tests/workers/hf_llama.py's elastic_plan), the elastic schedule, elastic_gpt_forward_step's per-token loss;
        saved by the first rank as OUT. --fault ignore: the masks left out (every token trains); shift: each label
        given its own token's mask instead of the next one's.
    pretrain FLAGS...                                  pretrain_gpt.py's main with these flags
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch
from megatron.core import parallel_state as ps

from megatron_epp.checkpoint import store
from megatron_epp.checkpoint.hf_convert import flag_line
from megatron_epp.checkpoint.hf_llama import read_spec
from megatron_epp.config.parser import parse_config
from megatron_epp.data.documents import DocumentDataset
from megatron_epp.data.sequence_sampler import SequenceSampler
from megatron_epp.executor.batches import elastic_gpt_forward_step, prepare_step
from megatron_epp.executor.context import ChunkContext, token_multiple
from megatron_epp.executor.schedule import forward_backward_elastic
from megatron_epp.model.gpt import build_model
from megatron_epp.model.runtime import initialize, shutdown
from megatron_epp.training.gpt_step import reduce_losses
from tests.workers.hf_llama import elastic_plan, run_import, run_pretrain
from tests.workers.runs import split_runs


def sequence_tensors(documents: DocumentDataset, sequences, fault: str | None) -> list[tuple[torch.Tensor, ...]]:
    """What ElasticTrainStep._prepare hands prepare_step: tokens, labels and the labels' masks (or a planted fault)."""
    out = []
    for s in sequences:
        tokens, labels = torch.from_numpy(s.tokens), torch.from_numpy(s.labels)
        if fault == "ignore":
            out.append((tokens, labels))
            continue
        mask = documents.loss_mask(s.doc_index)[: len(s.tokens)] if fault == "shift" else s.loss_mask
        out.append((tokens, labels, torch.from_numpy(mask)))
    return out


def run_loss(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    for name in ("hf_dir", "save", "prefix", "out", "pp", "cp"):
        p.add_argument(name)
    p.add_argument("--fault", choices=["ignore", "shift"], default=None)
    a = p.parse_args(argv)
    flags = shlex.split(flag_line(read_spec(a.hf_dir), a.hf_dir, 1))[1:]  # the flag line the import prints
    cfg = parse_config(flags + [
        "--mock-data", "--load", a.save, "--finetune", "--pipeline-model-parallel-size", a.pp, "--context-parallel-size", a.cp,
        "--elastic-pp", "--seq-length", "256"])
    runtime = initialize(cfg)
    model, config = build_model(cfg, runtime, context=ChunkContext())
    store.load_model_weights(cfg, 0, model, runtime)
    documents = DocumentDataset(a.prefix, loss_masks=True)
    batch = next(SequenceSampler(documents, len(documents), cfg.model.seq_length).iterate())
    sequences = batch.sequences()
    plan = elastic_plan([len(s.tokens) for s in sequences], runtime.dims.pp, cfg.model.num_layers)
    inputs = prepare_step(plan, runtime.pp_rank, sequence_tensors(documents, sequences, a.fault), runtime.device,
                          token_multiple(config), runtime.cp_rank, runtime.dims.cp)
    model.zero_grad_buffer()
    losses = forward_backward_elastic(forward_step_func=elastic_gpt_forward_step, data_iterator=iter(inputs.batches), model=[model],
                                      num_microbatches=len(inputs.batches), plan=plan, views=inputs.views)
    loss = reduce_losses(losses, ps.get_data_parallel_group(with_context_parallel=True))
    if runtime.is_last_stage and runtime.dp_rank == 0 and runtime.cp_rank == 0:
        torch.save({"loss": loss, "chunks": plan.chunk_counts(), "doc_indices": [s.doc_index for s in sequences]}, a.out)
    torch.distributed.barrier()


def main() -> None:
    for i, argv in enumerate(split_runs(sys.argv[1:])):
        if i:
            ps.destroy_model_parallel()
        {"import": run_import, "loss": run_loss, "pretrain": run_pretrain}[argv[0]](argv[1:])
    shutdown()


if __name__ == "__main__":
    sys.exit(main())
