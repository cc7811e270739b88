"""RoPE's table: one per run, built with the model, fp32, indexed per chunk.

megatron-core's ``RotaryEmbedding.forward`` caches one fp32 table per length asked for (``lru_cache(maxsize=32)``); elastic
chunks have a new length nearly every time, so asking it per chunk piled up to 32 tables on the device (about 0.5 GB
at 32K positions), inside the measured training steps. :class:`megatron_epp.executor.rotary.RopeTable` is built once,
for the run's ``--seq-length`` positions, when the model is built (``install_chunk_context``), and every chunk gathers
its rows from it. Checked here: 100 chunk lengths run on that one table (no op builds another, megatron-core's cache
does not grow; the per-length call planted back is seen), the table exists in fp32 after ``build_model --bf16``
(``Float16Module`` casts buffers, not this attribute), and a chunk past it is refused with one line. That its rows are
megatron-core's bit for bit, and the rotation with them, is ``tests/unit/test_layer_op_count.py``'s.
"""

from __future__ import annotations


import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_epp.executor import rotary
from megatron_epp.executor.context import ChunkContext, ChunkView
from megatron_epp.plan import Chunk, Segment
from megatron_epp.measure.layer_bench import init_single_process
from tests.unit.test_layer_op_count import CountOps

SEQ_LENGTH = 4096


def chunk_views(count: int) -> list[ChunkView]:
    """``count`` chunks of as many different lengths: whole documents, slices at a context, packed pairs."""
    views = []
    for i in range(count):
        n = 7 + 37 * i  # up to 3670 tokens
        if i % 3 == 0:
            chunk, lengths = Chunk(i, "batched", [Segment(0, 0, n)]), [n]
        elif i % 3 == 1:  # a slice ending at position SEQ_LENGTH - i (the first at the table's last row)
            end = SEQ_LENGTH - (i - 1)
            chunk, lengths = Chunk(i, "split", [Segment(0, end - n, end)]), [end]
        else:
            chunk, lengths = Chunk(i, "batched", [Segment(0, 0, n // 2), Segment(1, 0, n - n // 2)]), [n // 2, n - n // 2]
        views.append(ChunkView.build(chunk, lengths, torch.device("cpu")))
    return views


@pytest.mark.parametrize("planted", [False, True], ids=["one-table", "per-length-planted"])
def test_one_table_for_every_chunk_length(monkeypatch, planted):
    """100 chunks of 100 lengths (up to the last position of --seq-length) gather their angles, and their cos/sin'
    tables in bf16, from the one table built at the start: no op but the gather and the tables' own runs, megatron-core's
    per-length cache does not grow, and every chunk's angles are the table's rows. ``per-length-planted``: megatron-core's
    ``RotaryEmbedding`` asked per chunk again (as before 2026-11-27) must be seen (its cache grows, tables are built)."""
    init_single_process()
    context = ChunkContext()
    embedding = rotary.ChunkRotaryEmbedding(RotaryEmbedding(16, 1.0, use_cpu_initialization=True), context, SEQ_LENGTH)
    table = embedding.build_table()
    assert table.freqs.shape == (SEQ_LENGTH, 1, 1, 16) and table.freqs.dtype == torch.float32
    if planted:
        monkeypatch.setattr(rotary.RopeTable, "at", lambda self, view: self.inner(view.max_position + 1)[view.position_ids])
    views = chunk_views(100)
    assert len({view.max_position for view in views}) == 100 and max(view.max_position for view in views) == SEQ_LENGTH - 1
    before = RotaryEmbedding.forward.cache_info()  # one cache for every RotaryEmbedding of the process
    with CountOps() as counted:
        for view in views:
            with context.running(view):
                rope = embedding(view.num_tokens)
                freqs = rope.freqs()
                rope.tables(torch.bfloat16)
                assert torch.equal(freqs, table.freqs[view.position_ids])
    after = RotaryEmbedding.forward.cache_info()
    added, grown = after.misses - before.misses, after.currsize - before.currsize  # tables megatron-core built and kept
    built = {op: n for op, n in counted.ops.items() if op in ("arange", "outer", "cat")}
    if planted:
        assert added == 100 and after.currsize == 32 and built, (added, after, built)  # a table per length, the last 32 kept
        return
    assert embedding.table is table and added == grown == 0 and built == {}, (added, grown, built)
    # per chunk: the gather of freqs() (equal above: a second one), and the tables' gather, cos, sin, casts, negation
    assert counted.ops["index"] == 3 * 100 and counted.ops["cos"] == counted.ops["sin"] == 100


def test_table_is_built_with_the_model_in_fp32():
    """``build_model`` with ``--elastic-pp --bf16`` on RoPE: the table of --seq-length positions exists before any step
    (built on the model's device when the model is), fp32 while every parameter is bf16 (``Float16Module``), and is no
    buffer or parameter of the model (which the cast, a checkpoint and DDP would take)."""
    from megatron.core.utils import unwrap_model

    from megatron_epp.base.dims import ParallelDims
    from megatron_epp.config.parser import parse_config
    from megatron_epp.model.runtime import Runtime
    from megatron_epp.model.gpt import build_model

    init_single_process()
    args = parse_config(["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "96",
                         "--max-position-embeddings", "128", "--position-embedding-type", "rope", "--elastic-pp", "--bf16"],
                        world_size=1).replace(model={"vocab_size": 64})
    runtime = Runtime(torch.device("cpu"), rank=0, pp_rank=0, tp_rank=0, dp_rank=0, dims=ParallelDims())
    model, _ = build_model(args, runtime, context=ChunkContext())
    gpt = unwrap_model(model)
    table = gpt.rotary_pos_emb.table
    assert table is not None and table.freqs.shape == (96, 1, 1, 8) and table.freqs.dtype == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert dict(gpt.rotary_pos_emb.named_buffers()) == {} and dict(gpt.rotary_pos_emb.named_parameters()) == {}
    tensors = [*gpt.buffers(), *gpt.parameters(), *(t for t in gpt.state_dict().values() if isinstance(t, torch.Tensor))]
    assert table.freqs.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in tensors}
    view = ChunkView.build(Chunk(0, "split", [Segment(0, 40, 96)]), [96], torch.device("cpu"))
    with gpt.rotary_pos_emb.context.running(view):  # what a chunk gets: megatron-core's fp32 angles
        freqs = gpt.rotary_pos_emb(view.num_tokens).freqs()
    assert freqs.dtype == torch.float32 and torch.equal(freqs, gpt.rotary_pos_emb.inner(96)[view.position_ids])


def test_position_past_the_table_is_refused():
    """A chunk reaching position --seq-length or beyond: one line, naming the chunk, its position and the table."""
    init_single_process()
    context = ChunkContext()
    embedding = rotary.ChunkRotaryEmbedding(RotaryEmbedding(16, 1.0, use_cpu_initialization=True), context, 64)
    embedding.build_table()
    inside = ChunkView.build(Chunk(3, "split", [Segment(0, 60, 64)]), [64], torch.device("cpu"))
    past = ChunkView.build(Chunk(4, "split", [Segment(0, 60, 65)]), [65], torch.device("cpu"))
    with context.running(inside):
        assert embedding(4).freqs().shape == (4, 1, 1, 16)
    with context.running(past), pytest.raises(ValueError) as refused:
        embedding(5).freqs()
    message = str(refused.value)
    assert message == ("elastic RoPE: chunk 4 reaches position 64, past the run's table of --seq-length 64 positions "
                       "(documents are at most --seq-length tokens)") and "\n" not in message
    unbuilt = rotary.ChunkRotaryEmbedding(RotaryEmbedding(16, 1.0, use_cpu_initialization=True), context, 64)
    with context.running(inside), pytest.raises(RuntimeError, match="no table; build_table"):
        unbuilt(4)
