"""Patches for the places in megatron-core 0.16.1 that hard-code CUDA devices.

Two mechanisms, each applied to named upstream code:
  * ``_module_patch``: rebind the module-global ``torch`` of one upstream module to
    :class:`CpuTorch` (allocations on ``cuda`` go to the CPU, stream/sync calls are no-ops);
  * ``_scoped_patch``: run one upstream function inside a context that makes a CUDA-only tensor
    method harmless on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

from patches._cpu_torch import CpuTorch, tensor_cuda_is_identity, tensor_type_reports_cuda
from patches._registry import Patch, replace, require_supported_version, resolve_owner


def _module_patch(name: str, module: str | tuple[str, ...], why: str) -> Patch:
    modules = (module,) if isinstance(module, str) else module

    def apply() -> None:
        require_supported_version(name, ", ".join(modules))
        for one in modules:
            replace(one, "torch", CpuTorch())

    return Patch(name, f"{', '.join(modules)} (module-global torch)", why, apply)


def _scoped_patch(
    name: str, owner: str, attr: str, context: Callable[[], contextlib.AbstractContextManager[None]], why: str
) -> Patch:
    def apply() -> None:
        require_supported_version(name, owner)
        original = getattr(resolve_owner(owner), attr)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            with context():
                return original(*args, **kwargs)

        replace(owner, attr, wrapper)

    return Patch(name, f"{owner}.{attr}", why, apply)


SCHEDULES = _module_patch(
    "schedules_token_count",
    "megatron.core.pipeline_parallel.schedules",
    "forward_backward_no_pipelining / forward_backward_pipelining_without_interleaving allocate the "
    "total_num_tokens counter with device='cuda'.",
)
P2P = _module_patch(
    "p2p_cpu_buffers",
    "megatron.core.pipeline_parallel.p2p_communication",
    "P2PCommunicator._communicate allocates receive buffers on torch.cuda.current_device() and calls "
    "torch.cuda.synchronize() after batched isend/irecv.",
)
ATTENTION_MASK = _module_patch(
    "causal_mask_cpu",
    "megatron.core.transformer.utils",
    "get_default_causal_mask builds the default causal mask with device='cuda' (the local "
    "DotProductAttention uses it when no mask is passed).",
)
GLOBAL_BUFFER = _module_patch(
    "global_memory_buffer_cpu",
    "megatron.core.utils",
    "GlobalMemoryBuffer.get_tensor allocates on torch.cuda.current_device() (local attention's "
    "baddbmm scratch buffer).",
)
GRAD_BUFFER = _module_patch(
    "grad_buffer_cpu",
    "megatron.core.distributed.param_and_grad_buffer",
    "_ParamAndGradBuffer allocates param/grad buffers on torch.cuda.current_device() and bucket "
    "groups use torch.cuda streams.",
)
SEQUENCE_PARALLEL = _module_patch(
    "sequence_parallel_cpu",
    ("megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.layers"),
    "sequence parallelism's collectives allocate on torch.cuda.current_device(): _gather_along_first_dim / "
    "_reduce_scatter_along_first_dim their outputs, LinearWithGradAccumulationAndAsyncCommunication.backward "
    "the all-gathered input of a sequence-parallel linear.",
)
ROTARY = _module_patch(
    "rotary_cpu",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "RotaryEmbedding moves inv_freq to torch.cuda.current_device().",
)
OPTIMIZER = _module_patch(
    "optimizer_cpu",
    "megatron.core.optimizer.optimizer",
    "FP32Optimizer / MixedPrecisionOptimizer keep the loss scale and found-inf flag with device='cuda'.",
)
GRAD_SCALER = _module_patch(
    "grad_scaler_cpu",
    "megatron.core.optimizer.grad_scaler",
    "ConstantGradScaler / DynamicGradScaler (--fp16's loss scale) keep the scale and its factors with device='cuda'.",
)
CLIP_GRADS = _module_patch(
    "clip_grads_cpu",
    "megatron.core.optimizer.clip_grads",
    "get_grad_norm_fp32 / clip_grad_by_total_norm_fp32 build the norm and overflow buffers with "
    "device='cuda'.",
)
CLIP_GRADS_TYPE = _scoped_patch(
    "clip_grads_type_check",
    "megatron.core.optimizer.optimizer",
    "clip_grad_by_total_norm_fp32",
    tensor_type_reports_cuda,
    "clip_grad_by_total_norm_fp32 (imported into optimizer.py, where MegatronOptimizer.step calls "
    "it) asserts param.grad.type() == 'torch.cuda.FloatTensor'.",
)
CHECKPOINT_WRITER = _module_patch(
    "checkpoint_writer_cpu",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "FileSystemWriterAsync.preload_tensors calls torch.cuda.synchronize() before copying tensors out.",
)
CHECKPOINT_SAVER = _module_patch(
    "checkpoint_saver_cpu",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "save_state_dict_async_finalize all-reduces the write-failure flag on torch.cuda.current_device().",
)
FP16_OPTIMIZER_TYPE = _scoped_patch(
    "bf16_optimizer_type_check",
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params",
    "__init__",
    tensor_type_reports_cuda,
    "Float16OptimizerWithFloat16Params.__init__ accepts only params whose type() is "
    "torch.cuda.{Half,BFloat16,Float}Tensor (--bf16 on CPU).",
)
TIED_EMBEDDING = _scoped_patch(
    "tied_embedding_cpu",
    "megatron.core.models.common.language_module.language_module:LanguageModule",
    "setup_embeddings_and_output_layer",
    tensor_cuda_is_identity,
    "setup_embeddings_and_output_layer moves the shared embedding weight to CUDA before the "
    "first/last-stage all-reduce that gives both copies the same initial values.",
)
DISTRIBUTED_OPTIMIZER_TYPE = _scoped_patch(
    "distributed_optimizer_type_check",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
    "__init__",
    tensor_type_reports_cuda,
    "DistributedOptimizer.__init__ accepts only params whose type() is torch.cuda.{Half,BFloat16,Float}Tensor "
    "(--use-distributed-optimizer on CPU).",
)
