"""Context parallelism's host-side split of a chunk (each rank's token block, positions and batch) and its K/V head
replication, without a process group (the all-to-all and the equivalence with the reference:
tests/integration/test_elastic_equivalence.py's test_context_parallel_*)."""

from __future__ import annotations

import pytest
import torch

from megatron_epp.executor.attention import replicate_kv_heads
from megatron_epp.executor.batches import chunk_batches
from megatron_epp.executor.context import ChunkView
from megatron_epp.plan import Chunk, Pipeline, Plan, Segment

LENGTHS = [7, 12]
# a hybrid chunk: the tail slice [5, 12) of sequence 1 with the whole sequence 0 (14 tokens)
CHUNKS = [Chunk(0, "split", [Segment(1, 0, 5)]), Chunk(1, "hybrid", [Segment(1, 5, 12), Segment(0, 0, 7)])]


@pytest.mark.parametrize("cp, tp", [(2, 1), (4, 1), (2, 2), (3, 1)])
def test_ranks_blocks_make_the_padded_chunk(cp, tp):
    """Each chunk padded to a multiple of cp x tp (sequence parallelism), split in cp equal blocks: the ranks' positions
    and batches, in rank order, are the whole padded chunk's; the padding's loss mask is 0."""
    plan = Plan(LENGTHS, 1, [2], [Pipeline(CHUNKS, [[0, 0]])], builder="test").validate()
    sequences = [(torch.arange(n) + 100 * s, torch.arange(n) + 100 * s + 1) for s, n in enumerate(LENGTHS)]
    whole = list(chunk_batches(plan, sequences, torch.device("cpu"), cp * tp))
    ranks = [list(chunk_batches(plan, sequences, torch.device("cpu"), cp * tp, r, cp)) for r in range(cp)]
    for c, chunk in enumerate(CHUNKS):
        views = [ChunkView.build(chunk, LENGTHS, torch.device("cpu"), multiple=cp * tp, cp_rank=r, cp_size=cp) for r in range(cp)]
        assert views[0].num_tokens % (cp * tp) == 0 and views[0].num_tokens - chunk.num_tokens < cp * tp
        assert torch.equal(torch.cat([lay.local_position_ids for lay in views]), views[0].position_ids)
        assert [lay.local_range for lay in views] == [(r * lay.local_tokens, (r + 1) * lay.local_tokens) for r, lay in enumerate(views)]
        for key in ("tokens", "labels", "loss_mask"):
            assert torch.equal(torch.cat([ranks[r][c][key] for r in range(cp)], dim=1), whole[c][key]), key
        assert whole[c]["loss_mask"].sum() == chunk.num_tokens


def test_layout_refuses_a_padding_that_does_not_split_over_the_ranks():
    with pytest.raises(ValueError, match="context parallelism: rank 0 of 2 with chunks padded to a multiple of 1"):
        ChunkView.build(CHUNKS[0], LENGTHS, torch.device("cpu"), cp_rank=0, cp_size=2)


@pytest.mark.parametrize("heads, kv_heads, cp", [(4, 4, 2), (4, 2, 2), (4, 1, 2), (4, 1, 4), (32, 8, 16), (12, 4, 6), (8, 2, 8)])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(heads, kv_heads, cp):
    """After the all-to-all rank r holds query heads [r h/N, (r+1) h/N) and the r-th N-th of the (replicated) K/V heads;
    query head i must read K/V head i // (h / kv) of the model (megatron-core's grouping). GQA with 8 K/V heads at
    N = 16 included: each K/V head repeated twice, one per rank."""
    kv = torch.randn(3, 1, kv_heads, 2)
    replicated = replicate_kv_heads(kv, cp)
    assert replicated.shape[2] % cp == 0
    if kv_heads % cp == 0:
        assert replicated is kv  # split, not copied
    q_local, kv_local = heads // cp, replicated.shape[2] // cp
    assert q_local % kv_local == 0
    for i in range(heads):
        rank, local = divmod(i, q_local)
        read = rank * kv_local + local // (q_local // kv_local)  # what the rank's GQA attention reads
        assert torch.equal(replicated[:, :, read], kv[:, :, i // (heads // kv_heads)]), i
