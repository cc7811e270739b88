"""The schedule's hot path: per-chunk inputs arrive prebuilt and no op of a chunk reads a tensor back to the host.

In process (world size 1, gloo, pp = 1, the model of ``test_chunk_context``): a step over
:func:`prepare_step`'s inputs (a split sequence in three slices with prefix K/V, a packed chunk,
one chunk recomputed) must (1) not build a view (``ChunkView.build`` raises inside the schedule)
and (2) run no ``aten._local_scalar_dense`` (what ``.item()``, ``int(tensor)``, ``bool(tensor)``
dispatch to: a host-device sync on CUDA), counted by a ``TorchDispatchMode`` on CPU, but the one of the
step's end: the world's agreement that no rank ran out of memory, read before any gradient is reduced. A rotary
embedding that reads the largest position back from the tensor (the old ``int(positions.max())``)
turns the second test red.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_epp.executor import rotary
from megatron_epp.executor.batches import elastic_gpt_forward_step, prepare_step
from megatron_epp.executor.context import ChunkView
from megatron_epp.executor.schedule import forward_backward_elastic
from tests.unit.test_chunk_context import CHUNKS, PLAN, VOCAB, model  # noqa: F401  (the model fixture)


class CountHostReads(TorchDispatchMode):
    """Counts ops that copy a tensor's value to the host (``.item()`` and friends)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def prepared_step(model, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, VOCAB, (n + 1,), generator=gen) for n in PLAN.seq_lengths]
    inputs = prepare_step(PLAN, 0, [(d[:-1], d[1:]) for d in docs], torch.device("cpu"))

    def no_build(*args, **kwargs):
        raise AssertionError("a chunk view was built inside the schedule")

    monkeypatch.setattr(ChunkView, "build", classmethod(no_build))
    with CountHostReads() as mode:
        losses = forward_backward_elastic(
            forward_step_func=elastic_gpt_forward_step, data_iterator=iter(inputs.batches), model=[model],
            num_microbatches=len(CHUNKS), plan=PLAN, views=inputs.views,
        )
    return losses, mode.reads


def test_prepared_inputs_and_no_host_reads(model, monkeypatch):  # noqa: F811
    losses, reads = prepared_step(model, monkeypatch)
    assert len(losses) == len(CHUNKS) and all(torch.isfinite(x["lm loss"]).all() for x in losses)
    assert len(reads) == 1, f"{len(reads)} host reads in the schedule: {reads[:3]}"  # the out-of-memory agreement


def test_a_host_read_is_counted(model, monkeypatch):  # noqa: F811
    """The counter sees a planted sync: RoPE reading its table length from the positions tensor."""

    def forward(self, max_seq_len, offset=0, packed_seq=False, cp_group=None):
        positions = self.context.view().position_ids
        return self.inner(int(positions.max()) + 1)[positions]

    monkeypatch.setattr(rotary.ChunkRotaryEmbedding, "forward", forward)
    _, reads = prepared_step(model, monkeypatch)
    assert len(reads) == len(CHUNKS) + 1, reads  # one per chunk forward (the recompute reuses the rotary table), the agreement


def test_layouts_must_match_the_plan(model):  # noqa: F811
    inputs = prepare_step(PLAN, 0, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="views do not match"):
        forward_backward_elastic(forward_step_func=elastic_gpt_forward_step, data_iterator=iter(inputs.batches), model=[model],
                                 num_microbatches=len(CHUNKS), plan=PLAN, views=[inputs.views[0][:-1]])
