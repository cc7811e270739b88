"""Timing and memory measurement of the transformer layer that trains, on this machine.

Used by ``scripts/profile_layer.py`` (fits a profile) and ``scripts/cost_model_accuracy.py``
(checks it on real chunks).

The layers are built through the training spec (``elastic_base_layer_spec()`` passed through
``elastic_layer_spec``): :class:`ChunkRecomputeLayer` with :class:`ElasticAttention` as core attention
(one SDPA call per segment on CPU; a slice attends to its prefix K/V, read in place from its K/V
buffer, through a bottom-right causal mask), RoPE (when the shape has it) through the chunk rotary embedding, all reading the stack's own
:class:`ChunkContext`. A checkpointed forward recomputes as training does (the layout's recompute
count, megatron-core's ``tensor_parallel.checkpoint``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

import patches
from megatron_epp.cost.profiles import ModelShape
from megatron_epp.executor.context import ChunkContext, ChunkLayout, KVBuffer
from megatron_epp.executor.memory_tracker import ActivationMemoryTracker
from megatron_epp.executor.rotary import ChunkRotaryEmbedding
from megatron_epp.executor.spec import elastic_layer_spec
from megatron_epp.plan import Chunk, Segment
from megatron_epp.training.model import architecture_config, elastic_base_layer_spec


_initialized = False


def init_single_process() -> None:
    """One-process gloo group and Megatron's model-parallel state (TP = PP = 1), one thread, and
    the CPU patches training applies (RoPE's and the recompute's device and RNG calls)."""
    global _initialized
    if _initialized:
        return
    patches.apply_cpu_patches()
    torch.set_num_threads(1)
    if not torch.distributed.is_initialized():
        # an in-memory store: one process needs no rendezvous port (a port taken by another job on the
        # machine made concurrent runs fail with EADDRINUSE)
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    _initialized = True


class LayerStack(torch.nn.Module):
    """``num_layers`` transformer layers of the training spec with prefix attention, plus the output head.

    :meth:`set_segments` makes a chunk current in the stack's own context until the next call, so a
    forward and its backward (recompute included) run on that chunk.
    """

    def __init__(self, shape: ModelShape, num_layers: int, seed: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        init_single_process()
        torch.manual_seed(seed)
        self.device, self.dtype = torch.device(device), dtype
        on_cpu = self.device.type == "cpu"
        config = TransformerConfig(
            num_layers=num_layers,
            hidden_size=shape.hidden,
            num_attention_heads=shape.num_heads,
            ffn_hidden_size=shape.ffn_hidden,
            **architecture_config(swiglu=shape.swiglu, normalization=shape.normalization, num_query_groups=shape.num_kv_heads,
                                  kv_channels=shape.kv_channels, bias=shape.bias),
            use_cpu_initialization=on_cpu,  # else RoPE's frequencies are made on the current GPU
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        self.context = ChunkContext()
        spec = elastic_layer_spec(elastic_base_layer_spec(shape.normalization), self.context)
        self.layers = torch.nn.ModuleList(build_module(spec, config=config, layer_number=i + 1) for i in range(num_layers))
        self.rotary = ChunkRotaryEmbedding(RotaryEmbedding(config.kv_channels, rotary_percent=1.0, use_cpu_initialization=on_cpu), self.context) if shape.rope else None
        self.head = torch.nn.Linear(shape.hidden, shape.vocab, bias=False)
        self.shape = shape
        self._recompute_layout: ChunkLayout | None = None
        self._prefixes: list[tuple[KVBuffer, int]] = []  # each slice's buffers and their prefix rows
        self.to(self.device, dtype)  # every parameter, LayerNorms included, as Float16Module does in training

    def set_segments(self, lengths: Sequence[int], contexts: Sequence[int]) -> None:
        """Make the segments ``(s, C)`` the current chunk; a slice of context ``C > 0`` (at most one, as
        in a plan) gets a K/V buffer per layer whose prefix rows ``[0, C)`` hold random K/V."""
        if sum(c > 0 for c in contexts) > 1:
            raise ValueError("a chunk holds at most one slice with context")
        heads, d = self.shape.num_kv_heads or self.shape.num_heads, self.shape.head_dim
        chunk = Chunk(0, "batched", [Segment(i, c, c + s) for i, (s, c) in enumerate(zip(lengths, contexts))])
        self.context.clear()
        self.context.current = ChunkLayout.build(chunk, [c + s for s, c in zip(lengths, contexts)], self.device)
        self._recompute_layout = dataclasses.replace(self.context.current, recompute=len(self.layers))
        self._prefixes = []
        for i, (s, c) in enumerate(zip(lengths, contexts)):
            for layer in self.layers if c else ():
                buffer = self.context.kv_buffer(i, layer.layer_number, c + s, torch.empty(0, 1, heads, d, device=self.device, dtype=self.dtype))
                buffer.write(0, *(torch.randn(c, 1, heads, d, device=self.device, dtype=self.dtype) for _ in range(2)))
                self._prefixes.append((buffer, c))

    def forward(self, x: torch.Tensor, checkpoint: bool = False) -> torch.Tensor:
        """Hidden states ``[s, 1, h]`` through every layer (each recomputing in backward if asked)."""
        for buffer, c in self._prefixes:
            buffer.written = c  # so that every timed forward writes its slice's K/V, as a first forward does
        with self.context.running(self._recompute_layout if checkpoint else self.context.layout()):
            rotary = self.rotary(x.shape[0]) if self.rotary is not None else None
            for layer in self.layers:
                x = layer(x, attention_mask=None, rotary_pos_emb=rotary)[0]
        return x

    def head_loss(self, x: torch.Tensor) -> torch.Tensor:
        """Output layer and summed cross entropy (fp32 logits) of hidden states ``[s, 1, h]``."""
        logits = self.head(x).float().view(-1, self.shape.vocab)
        return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device), reduction="sum")


def time_fwd_bwd(run: Callable[..., torch.Tensor], make_inputs: Callable[[], tuple], repeats: int) -> tuple[float, float]:
    """Fastest forward and backward ms of ``run(*make_inputs())`` over ``repeats`` (inputs made outside
    the timing). Measured as this process's CPU time: with one thread it equals the wall time on an
    idle core, and other processes sharing the machine do not inflate it."""
    fwd, bwd = [], []
    for i in range(repeats + 1):  # the first is a warm-up
        inputs = make_inputs()
        t0 = time.process_time()
        out = run(*inputs)
        t1 = time.process_time()
        (out if out.dim() == 0 else out.sum()).backward()
        t2 = time.process_time()
        if i:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    return min(fwd), min(bwd)


def saved_bytes(build: Callable[[], torch.Tensor], context: ChunkContext | None = None) -> int:
    """Peak bytes of distinct tensors autograd saves for backward while ``build()`` runs, plus the
    prefix K/V ``context`` keeps (none without a context)."""
    with ActivationMemoryTracker(torch.device("cpu"), context or ChunkContext()) as tracker:
        output = build()
    del output
    return tracker.peak_bytes
