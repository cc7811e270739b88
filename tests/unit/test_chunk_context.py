"""The executor's chunk context after a step: no current chunk and no kept prefix K/V, even when the step raises.

In process (world size 1, gloo, pp = 1): a two-layer GPT of the training spec through
``elastic_layer_spec`` with its own :class:`ChunkContext`, one sequence of 12 tokens in three split
slices (slices 0 and 1 keep K/V for the later ones) plus a batched chunk. A step that raises in the
third chunk's forward (while its chunk is current, after two slices kept K/V) or in its backward
must leave the context empty; so must a completed training step and a forward-only one.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_epp.executor.batches import chunk_batches, elastic_gpt_forward_step
from megatron_epp.executor.context import ChunkContext
from megatron_epp.executor.schedule import forward_backward_elastic
from megatron_epp.executor.spec import elastic_layer_spec, install_chunk_context
from megatron_epp.plan import Chunk, Pipeline, Plan, Segment
from megatron_epp.measure.layer_bench import init_single_process
from megatron_epp.model.gpt import elastic_base_layer_spec

VOCAB = 32
CHUNKS = [
    Chunk(0, "split", [Segment(0, 0, 4)]),
    Chunk(1, "split", [Segment(0, 4, 8)]),
    Chunk(2, "split", [Segment(0, 8, 12)]),
    Chunk(3, "batched", [Segment(1, 0, 5), Segment(2, 0, 3)]),
]
PLAN = Plan([12, 5, 3], 1, [2], [Pipeline(CHUNKS, [[1, 0, 0, 0]])], builder="test").validate()


class Boom(RuntimeError):
    pass


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise Boom("backward")


@pytest.fixture(scope="module")
def model() -> GPTModel:
    init_single_process()
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True,
    )
    context = ChunkContext()
    gpt = GPTModel(config, elastic_layer_spec(elastic_base_layer_spec(), context), vocab_size=VOCAB, max_sequence_length=64,
                   position_embedding_type="rope")
    install_chunk_context(gpt, context, 64)
    return gpt


def step(model: GPTModel, forward_step_func=elastic_gpt_forward_step, forward_only: bool = False):
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, VOCAB, (n + 1,), generator=gen) for n in PLAN.seq_lengths]
    return forward_backward_elastic(
        forward_step_func=forward_step_func, data_iterator=chunk_batches(PLAN, [(d[:-1], d[1:]) for d in docs], torch.device("cpu")),
        model=[model], num_microbatches=len(CHUNKS), forward_only=forward_only, plan=PLAN,
    )


def failing_at_third_chunk(where: str, seen: dict):
    """``elastic_gpt_forward_step`` that raises in the third chunk's forward (after the model ran) or backward."""
    calls = itertools.count()

    def forward_step(data_iterator, model):
        output, loss_func = elastic_gpt_forward_step(data_iterator, model)
        if next(calls) != 2:
            return output, loss_func
        context = ChunkContext.of(model)
        seen.update(kept=sorted(context.kv), current=context.current)
        if where == "forward":
            raise Boom("forward")
        return _RaiseInBackward.apply(output), loss_func

    return forward_step


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_step_that_raises_leaves_no_chunk_and_no_kept_kv(model, where):
    context = ChunkContext.of(model)
    seen: dict = {}
    with pytest.raises(Boom, match=where):
        step(model, failing_at_third_chunk(where, seen))
    assert seen["kept"] == [(0, 1), (0, 2)] and seen["current"].chunk is CHUNKS[2]  # the failure hit mid-step
    assert context.current is None and context.kv == {}


@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "forward_only"])
def test_completed_step_leaves_no_chunk_and_no_kept_kv(model, forward_only):
    context = ChunkContext.of(model)
    losses = step(model, forward_only=forward_only)
    assert len(losses) == len(CHUNKS) and context.current is None and context.kv == {}


def test_every_elastic_layer_reads_the_models_context(model):
    context = ChunkContext.of(model)
    readers = [m for m in model.modules() if hasattr(m, "context")]
    assert len(readers) == 5 and all(m.context is context for m in readers)  # 2 layers, 2 attentions, RoPE


def test_model_without_context_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"the model has no chunk context: build it with elastic_layer_spec\(base, context\)"):
        ChunkContext.of(torch.nn.Linear(1, 1))
