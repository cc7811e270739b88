"""Plan data model: validation names the broken chunk; JSON round trip; elastic 1F1B order."""

from __future__ import annotations

import re

import numpy as np
import pytest

from megatron_epp.plan import Chunk, Pipeline, Plan, PlanError, Segment
from megatron_epp.plan.order import Op, add_send_recv, backward_order, format_stage_ops, num_warmup, stage_ops

LENGTHS = [10, 3, 4, 12]


def make_plan(chunks: list[Chunk], groups: list[list[int]] | None = None, stages: int = 2) -> Plan:
    groups = groups or [list(range(len(chunks)))]
    pipes = [Pipeline([chunks[i] for i in g], [[0] * len(g) for _ in range(stages)]) for g in groups]
    return Plan(LENGTHS, stages, [2] * stages, pipes)


def good_chunks() -> list[Chunk]:
    return [
        Chunk(0, "split", [Segment(0, 0, 6)]),
        Chunk(1, "hybrid", [Segment(0, 6, 10), Segment(1, 0, 3)]),
        Chunk(2, "split", [Segment(3, 0, 5)]),
        Chunk(3, "split", [Segment(3, 5, 9)]),
        Chunk(4, "split", [Segment(3, 9, 12)]),
        Chunk(5, "batched", [Segment(2, 0, 4)]),
    ]


def test_valid_plan_round_trips_through_json():
    plan = make_plan(good_chunks()).validate()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert plan.chunk_counts() == {"batched": 1, "split": 4, "hybrid": 1}
    assert again.pipelines[0].chunks[1].position_ids() == [6, 7, 8, 9, 0, 1, 2]
    assert again.pipelines[0].chunks[1].cu_seqlens() == [0, 4, 7]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.__setitem__(slice(2, 4), [c[3], c[2]]),
         "chunk 3: sequence 3 tokens [5,9) start at 5 but no earlier chunk holds the sequence: tokens [0,5) are missing before it"),
        (lambda c: c.__setitem__(3, Chunk(3, "split", [Segment(3, 6, 9)])),
         "chunk 3: sequence 3 tokens [6,9) start at 6 but the previous slice (chunk 2) ended at 5: tokens [5,6) are missing before it"),
        (lambda c: c.__setitem__(3, Chunk(3, "split", [Segment(3, 4, 9)])),
         "chunk 3: sequence 3 tokens [4,9) start at 4 but the previous slice (chunk 2) ended at 5: tokens [4,5) are in two chunks"),
        (lambda c: c.append(Chunk(6, "batched", [Segment(2, 0, 4)])),
         "chunk 6: sequence 2 tokens [0,4) start at 0 but the previous slice (chunk 5) ended at 4: tokens [0,4) are in two chunks"),
        (lambda c: c.__setitem__(1, Chunk(1, "hybrid", [Segment(0, 6, 10), Segment(3, 9, 12)])), "chunk 1: holds 2 slices"),
        (lambda c: c.__setitem__(5, Chunk(5, "batched", [Segment(2, 0, 5)])), "chunk 5: bad token range"),
        (lambda c: c.pop(5), "sequence 2 (4 tokens) is in no chunk"),
        (lambda c: c.pop(4), "chunk 3: sequence 3 ends at token 9 of 12: tokens [9,12) are in no chunk"),
        (lambda c: c.__setitem__(5, Chunk(5, "split", [Segment(2, 0, 4)])), "chunk 5: kind is 'split' but its segments make it 'batched'"),
        (lambda c: c.__setitem__(1, Chunk(1, "hybrid", [Segment(0, 6, 9), Segment(1, 0, 3)])), "chunk 1: only a tail slice"),
        (lambda c: c.__setitem__(4, Chunk(2, "split", [Segment(3, 9, 12)])),
         "chunk 2: the id is used twice, at pipeline 0 position 2 and at pipeline 0 position 4"),
        (lambda c: c.__setitem__(4, Chunk(4.0, "split", [Segment(3, 9, 12)])), "chunk 4.0 (pipeline 0 position 4): the id must be an integer"),
        (lambda c: c.__setitem__(4, Chunk(True, "split", [Segment(3, 9, 12)])), "chunk True (pipeline 0 position 4): the id must be an integer"),
        (lambda c: c.__setitem__(4, Chunk(4, "split", [Segment(3, 9, 12.0)])), "chunk 4: segment Segment(seq=3, start=9, end=12.0) must hold integers"),
        (lambda c: c.__setitem__(4, Chunk(4, "split", [Segment(3, 9.5, 12)])), "chunk 4: segment Segment(seq=3, start=9.5, end=12) must hold integers"),
        (lambda c: c.__setitem__(5, Chunk(5, "batched", [Segment(False, 0, 10)])), "chunk 5: segment Segment(seq=False, start=0, end=10) must hold integers"),
    ],
)
def test_validate_names_the_broken_chunk(mutate, message):
    chunks = good_chunks()
    mutate(chunks)
    with pytest.raises(PlanError, match=f"^{re.escape(message)}"):
        make_plan(chunks).validate()


@pytest.mark.parametrize("lengths", [[10, 3, 4.0, 12], [10, 3, 4, True], [10.5, 3, 4, 12]])
def test_non_integer_sequence_lengths_are_rejected(lengths):
    plan = make_plan(good_chunks())
    plan.seq_lengths = lengths
    with pytest.raises(PlanError, match="^sequence lengths must be integers"):
        plan.validate()


@pytest.mark.parametrize("n", [1.0, True])
def test_non_integer_recompute_is_rejected(n):
    plan = make_plan(good_chunks())
    plan.pipelines[0].recompute[1][2] = n
    with pytest.raises(PlanError, match=f"^{re.escape(f'chunk 2: recompute {n!r} layers on stage 1 (must be an integer)')}$"):
        plan.validate()


def test_numpy_integers_are_integers():
    plan = make_plan(good_chunks())
    plan.seq_lengths = [np.int64(n) for n in plan.seq_lengths]
    plan.pipelines[0].chunks[0] = Chunk(np.int64(0), "split", [Segment(np.int64(0), np.int64(0), np.int64(6))])
    plan.validate()


def test_sequence_in_two_pipelines_is_rejected():
    with pytest.raises(PlanError, match="chunk 1: sequence 0 is in pipelines 0 and 1"):
        make_plan(good_chunks(), groups=[[0], [1, 2, 3, 4, 5]]).validate()


def test_recompute_beyond_stage_layers_is_rejected():
    plan = make_plan(good_chunks())
    plan.pipelines[0].recompute[1][2] = 3
    with pytest.raises(PlanError, match="chunk 2: recompute 3 layers on stage 1"):
        plan.validate()


def test_backward_runs_sequences_fifo_and_slices_last_to_first():
    pipe = make_plan(good_chunks()).pipelines[0]
    assert backward_order(pipe) == [1, 0, 4, 3, 2, 5]


def test_warmup_is_megatron_1f1b_when_nothing_is_split():
    chunks = [Chunk(i, "batched", [Segment(i, 0, n)]) for i, n in enumerate(LENGTHS)]
    pipe = make_plan(chunks, stages=4).pipelines[0]
    assert [num_warmup(pipe, p, 4) for p in range(4)] == [3, 2, 1, 0]


def test_stage_ops_run_each_chunk_once_and_backward_after_forward():
    pipe = make_plan(good_chunks(), stages=3).pipelines[0]
    assert [num_warmup(pipe, p, 3) for p in range(3)] == [4, 3, 2]  # P - p - 1 + K_max - 1, K_max = 3
    for stage in range(3):
        ops = stage_ops(pipe, stage, 3)
        assert sorted(o.pos for o in ops if o.kind == "F") == list(range(6))
        assert [o.pos for o in ops if o.kind == "B"] == backward_order(pipe)
        done = set()
        for op in ops:
            assert op.kind == "F" or op.pos in done
            done.add(op.pos)


def test_format_stage_ops_is_a_table_of_each_stages_op_order():
    plan = make_plan(good_chunks(), groups=[[0, 1], [2, 3, 4, 5]])
    assert format_stage_ops(plan, comms=False) == """\
            Stage 0  Stage 1
Step 00 p0  F0s      F0s
Step 01 p0  F1h      F1h
Step 02 p0  B1h      B1h
Step 03 p0  B0s      B0s
Step 04 p1  F2s      F2s
Step 05 p1  F3s      F3s
Step 06 p1  F4s      F4s
Step 07 p1  F5       B4s
Step 08 p1  B4s      F5
Step 09 p1  B3s      B3s
Step 10 p1  B2s      B2s
Step 11 p1  B5       B5"""
    # with the sends and receives (the default): a receive batched with the send before it reads "+RECV"; the
    # last stage has fewer ops in pipeline 0 (no RECV_B), its last cell of that pipeline blank
    assert format_stage_ops(plan) == """\
            Stage 0    Stage 1
Step 00 p0  F0s        RECV_F0s
Step 01 p0  SEND_F0s   F0s
Step 02 p0  F1h        RECV_F1h
Step 03 p0  SEND_F1h   F1h
Step 04 p0  +RECV_B1h  B1h
Step 05 p0  B1h        SEND_B1h
Step 06 p0  RECV_B0s   B0s
Step 07 p0  B0s        SEND_B0s
Step 08 p1  F2s        RECV_F2s
Step 09 p1  SEND_F2s   F2s
Step 10 p1  F3s        RECV_F3s
Step 11 p1  SEND_F3s   F3s
Step 12 p1  F4s        RECV_F4s
Step 13 p1  SEND_F4s   F4s
Step 14 p1  F5         B4s
Step 15 p1  SEND_F5    SEND_B4s
Step 16 p1  +RECV_B4s  +RECV_F5
Step 17 p1  B4s        F5
Step 18 p1  RECV_B3s   B3s
Step 19 p1  B3s        SEND_B3s
Step 20 p1  RECV_B2s   B2s
Step 21 p1  B2s        SEND_B2s
Step 22 p1  RECV_B5    B5
Step 23 p1  B5         SEND_B5"""
    pipe = Pipeline([Chunk(7, "batched", [Segment(0, 0, 10)]), Chunk(9, "batched", [Segment(1, 0, 3)])], [[0, 0]] * 3)
    assert format_stage_ops(pipe, 3, comms=False).splitlines() == [
        "        Stage 0  Stage 1  Stage 2",
        "Step 0  F7       F7       F7",
        "Step 1  F9       F9       B7",
        "Step 2  B7       B7       F9",
        "Step 3  B9       B9       B9",
    ]
    with pytest.raises(ValueError, match="needs num_stages"):
        format_stage_ops(pipe)


def test_ops_read_as_they_print():
    ops = Op.list_from_str("RECV_F0 F0 SEND_F0 +RECV_B1 B1 SEND_B1 +RECV_F2")
    assert ops[3] == Op("RECV_B", 1, batched=True) and ops[1] == Op("F", 0) and ops[5] == Op("SEND_B", 1)
    assert " ".join(map(str, ops)) == "RECV_F0 F0 SEND_F0 +RECV_B1 B1 SEND_B1 +RECV_F2"
    for bad in ("X3", "F", "+SEND_F3", "+F1", "F-1", "RECV_F3+"):
        with pytest.raises(ValueError, match="not an op"):
            Op.from_str(bad)


def test_sends_and_receives_are_ops_of_each_stages_list():
    """1F1B on three stages: each op receives its input just before it runs (batched with the send before it where
    the send goes the other way) and sends its result right after; nothing crosses a pipeline end; every send
    has its receive on the neighbouring stage, in the same order."""
    pipe = Pipeline([Chunk(i, "batched", [Segment(i, 0, 2)]) for i in range(3)], [[0] * 3] * 3)
    assert stage_ops(pipe, 0, 3, comms=True) == Op.list_from_str(
        "F0 SEND_F0 F1 SEND_F1 F2 SEND_F2 +RECV_B0 B0 RECV_B1 B1 RECV_B2 B2")
    assert stage_ops(pipe, 1, 3, comms=True) == Op.list_from_str(
        "RECV_F0 F0 SEND_F0 RECV_F1 F1 SEND_F1 +RECV_B0 B0 SEND_B0 +RECV_F2 F2 SEND_F2 +RECV_B1 B1 SEND_B1 RECV_B2 B2 SEND_B2")
    assert stage_ops(pipe, 2, 3, comms=True) == Op.list_from_str(
        "RECV_F0 F0 B0 SEND_B0 +RECV_F1 F1 B1 SEND_B1 +RECV_F2 F2 B2 SEND_B2")
    assert stage_ops(pipe, 1, 3, comms=True, forward_only=True) == Op.list_from_str("RECV_F0 F0 SEND_F0 RECV_F1 F1 SEND_F1 RECV_F2 F2 SEND_F2")
    assert stage_ops(pipe, 0, 1, comms=True) == stage_ops(pipe, 0, 1)  # one stage: nothing to send
    pipe = make_plan(good_chunks(), stages=4).pipelines[0]
    lists = [stage_ops(pipe, p, 4, comms=True) for p in range(4)]
    for p in range(4):
        assert [op for op in lists[p] if op.kind in ("F", "B")] == stage_ops(pipe, p, 4)
        for send, recv, to in (("SEND_F", "RECV_F", p + 1), ("SEND_B", "RECV_B", p - 1)):
            if 0 <= to < 4:
                assert [op.pos for op in lists[p] if op.kind == send] == [op.pos for op in lists[to] if op.kind == recv]
            else:
                assert not any(op.kind == send for op in lists[p])
    with pytest.raises(ValueError, match="takes compute ops"):
        add_send_recv(Op.list_from_str("F0 SEND_F0"), 0, 2)
