"""TransformerConfig, GPTModel for this pipeline stage, and Megatron-Core's DDP wrapper."""

from __future__ import annotations

import argparse

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_epp.training.initialize import Runtime


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def default_layer_spec() -> ModuleSpec:
    """Transformer Engine's layer spec when TE is importable on a GPU, else the local one."""
    if transformer_engine_available():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec()


def transformer_config(args: argparse.Namespace, runtime: Runtime) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        use_cpu_initialization=runtime.device.type == "cpu",
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        calculate_per_token_loss=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=runtime.device.type == "cuda",
        gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=True,
        # Megatron's batch_p2p_sync calls torch.cuda.synchronize() after every batched p2p (a guard
        # for a batch_isend_irecv race fixed in PyTorch long ago): a device sync per chunk and stage.
        batch_p2p_sync=False,
    )


def build_model(
    args: argparse.Namespace, runtime: Runtime, layer_spec: ModuleSpec | None = None
) -> tuple[DistributedDataParallel, TransformerConfig]:
    """This stage's GPTModel on its device, wrapped in Megatron-Core DDP."""
    config = transformer_config(args, runtime)
    model = GPTModel(
        config,
        layer_spec or default_layer_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=runtime.is_first_stage,
        post_process=runtime.is_last_stage,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
    model.to(runtime.device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    return DistributedDataParallel(config, ddp_config, model), config
