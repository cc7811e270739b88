"""Run one global batch through pretrain_gpt's model/optimizer stack and dump loss and gradients.

Launched by tests under torchrun. Parameters are set from their *global* name (layer numbers
offset by the stage), so every parallel layout starts from identical weights.
    torchrun --nproc-per-node N tests/workers/grad_dump.py OUT_DIR [pretrain_gpt flags...] [:: OUT_DIR [flags...]]...
Several runs (separated by ``::``) share the launch (one process start): each builds its own model-parallel
groups (same world size), model and optimizer, dumps, and tears the groups down for the next.
"""

from __future__ import annotations

import sys
import zlib

import torch

from megatron_epp.config.parser import parse_config
from megatron_epp.training.gpt_step import gpt_forward_step, microbatches, reduce_losses
from megatron_epp.model.runtime import initialize, shutdown
from megatron_epp.training.loop import build_optimizer
from megatron_epp.training.step import StockTrainStep, build_samples
from megatron_epp.model.gpt import build_model
from megatron.core import parallel_state as ps
from megatron.core.utils import unwrap_model
from tests.workers.runs import split_runs


def global_name(name: str, pp_rank: int, layers_per_stage: int) -> str:
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + pp_rank * layers_per_stage)
    if parts[0] == "output_layer":
        return "embedding.word_embeddings.weight"  # tied copy on the last stage
    return ".".join(parts)


def tensor_parallel_shard(full: torch.Tensor, name: str, dim: int, tp_rank: int, tp_size: int, gated: bool) -> torch.Tensor:
    """Rank ``tp_rank``'s shard (split along ``dim``) of the full (non-tensor-parallel) tensor of parameter ``name``.
    With a gated MLP (SwiGLU) fc1's output rows are ``[gate; up]``, and megatron-core gives each rank its share of
    both halves (``[gate_r; up_r]``), not a contiguous block of rows."""
    if gated and name.split(".")[-2] == "linear_fc1" and dim == 0:
        return torch.cat([half.chunk(tp_size, 0)[tp_rank] for half in full.chunk(2, 0)])
    return full.chunk(tp_size, dim)[tp_rank]


def set_global_weights(model: torch.nn.Module, pp_rank: int, layers_per_stage: int, tp_rank: int = 0, tp_size: int = 1,
                       gated: bool = False) -> None:
    """Every parameter from its global name; a tensor-parallel shard is its rank's slice of the full tensor
    (``gated``: the model's MLP is gated, SwiGLU: see :func:`tensor_parallel_shard`)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(global_name(name, pp_rank, layers_per_stage).encode()))
            base = 1.0 if "layernorm.weight" in name or name.endswith("layer_norm_weight") else 0.0
            dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
            shape = list(p.shape)
            if dim >= 0:
                shape[dim] *= tp_size
            full = base + 0.05 * torch.randn(shape, generator=g)
            p.copy_(tensor_parallel_shard(full, name, dim, tp_rank, tp_size, gated) if dim >= 0 else full)


def dump(out_dir: str, flags: list[str]) -> None:
    args = parse_config(flags)
    runtime = initialize(args)
    model, config = build_model(args, runtime)
    layers_per_stage = args.model.num_layers // runtime.dims.pp
    set_global_weights(unwrap_model(model), runtime.pp_rank, layers_per_stage, runtime.tp_rank, args.parallel.dims.tp,
                       args.model.swiglu)
    model.broadcast_params()
    build_optimizer(args, model, config)  # installs finalize_model_grads (DP and tied-embedding sync)
    batches = microbatches(build_samples(args, "train"), 0, args.training.global_batch_size, args.training.micro_batch_size, runtime.dp_rank, runtime.dims.dp, runtime.device)
    model.zero_grad_buffer()
    losses, _ = StockTrainStep(args, model, gpt_forward_step, batches)(False)
    loss = reduce_losses(losses, ps.get_data_parallel_group())
    grads = {
        global_name(n, runtime.pp_rank, layers_per_stage): p.main_grad.detach().clone()
        for n, p in unwrap_model(model).named_parameters()
    }
    if runtime.dp_rank == 0 and runtime.tp_rank == 0:
        torch.save({"loss": loss, "grads": grads}, f"{out_dir}/stage{runtime.pp_rank}.pt")


def main() -> None:
    for i, (out_dir, *flags) in enumerate(split_runs(sys.argv[1:])):
        if i:
            ps.destroy_model_parallel()  # the process group stays: the next run's initialize builds new groups on it
        dump(out_dir, flags)
    shutdown()


if __name__ == "__main__":
    main()
