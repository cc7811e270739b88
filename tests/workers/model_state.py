"""Model-state bytes of every rank, counted tensor by tensor, beside the planner's prediction, without and
with ``--use-distributed-optimizer`` (a model and optimizer built for each, in one launch).

    torchrun ... tests/workers/model_state.py OUT.json [pretrain_gpt flags, with --elastic-pp]

Counted on each rank: the parameters (in their dtype), their gradients (DDP's ``main_grad``, fp32) and
the optimizer's state tensors (Adam's moments; fp32 main copies of bf16 weights, i.e. the optimizer's
parameters that share no storage with the model's). Predicted: ``online_planner(args).cost_model``'s
``model_state_bytes`` of the rank's stage. The first rank writes every rank's records to OUT.json:
``{"plain": [...], "sharded": [...]}``, one record per rank each.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from megatron_epp.config.parser import parse_config
from megatron_epp.training.planning import online_planner
from megatron_epp.model.runtime import initialize, shutdown
from megatron_epp.training.loop import build_optimizer
from megatron_epp.model.gpt import build_model


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rank_record(args, runtime) -> dict:
    """This rank's counted and predicted bytes for a model and optimizer built from ``args``."""
    model, config = build_model(args, runtime)
    optimizer, _ = build_optimizer(args, model, config)
    params = [p for p in model.parameters()]
    model_storages = {p.untyped_storage().data_ptr() for p in params}
    states, main_params = [], []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        opt.init_state_fn(inner, opt.config)  # Adam's moments, as its first step allocates them
        for group in inner.param_groups:
            for p in group["params"]:
                states += [v for k, v in inner.state[p].items() if k != "step"]
                if p.untyped_storage().data_ptr() not in model_storages:
                    main_params.append(p)
    return {
        "pp": runtime.pp_rank, "tp": runtime.tp_rank, "dp": runtime.dp_rank,
        "weight": nbytes(params), "grad": nbytes(p.main_grad for p in params), "optim": nbytes(states) + nbytes(main_params),
        "predicted": float(online_planner(args).cost_model.model_state_bytes()[runtime.pp_rank]),
    }


def main() -> None:
    out, flags = sys.argv[1], sys.argv[2:]
    args = parse_config(["--vocab-size", "64", *flags])  # the test's flags come after and win
    runtime = initialize(args)
    result = {}
    for name, sharded in (("plain", False), ("sharded", True)):
        args = args.replace(parallel={"use_distributed_optimizer": sharded})
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, rank_record(args, runtime))
        result[name] = records
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    shutdown()


if __name__ == "__main__":
    main()
