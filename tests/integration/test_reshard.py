"""A checkpoint loads at another parallel layout (pretrain_gpt.py --elastic-pp, tiny model, gloo).

The reference run trains 5 steps at pp 2 with the distributed optimizer in megatron-core's fully_reshardable format
(--dist-ckpt-optim-fully-reshardable) and saves at 3. Resumed from 3 at pp 1 x dp 2 and at pp 1 x tp 2, and from
those at dp 1, cp 2 (context parallelism) and tp 1, every step has the reference's loss within fp32 tolerance: EPP's loss is the batch's, whatever
the layout, so the model, the optimizer states, the LR schedule and the data stream (sample position, DP split) all
carried over. A resume at tp 1 from tp 2 that saves at once holds the tp 2 run's model and optimizer tensors bit for bit.
The runs say in one line each what was resharded, that the RNG states restart, whether the planner's calibration
carries over; what cannot reshard is one line before any work."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_epp.config.parser import parse_config
from megatron_epp.config.errors import ArgumentError
from megatron_epp.checkpoint.integrity import hashed_by, check_loadable
from megatron_epp.checkpoint.records import TRACKER
from megatron_epp.training.metrics import read_metrics
from tests.integration.test_faults import SHORT
from tests.launch import torchrun

ITERS = 5
# the padded vocabulary is part of the model: 257 tokens pad to 512 rows at tp 1 with 256, at tp 2 with 128
RUN = [*SHORT, "--train-iters", str(ITERS), "--lr-decay-iters", str(ITERS), "--use-distributed-optimizer",
       "--make-vocab-size-divisible-by", "256"]
PP1 = ["--pipeline-model-parallel-size", "1"]
FULLY = "--dist-ckpt-optim-fully-reshardable"
TOLERANCE = 1e-5  # relative: fp32 sums in another order (another DP split or TP partition)


def _losses(path) -> dict[int, float]:
    return {m.iteration: m.loss for m in read_metrics(path) if m.kind == "train"} if path.exists() else {}  # no step: no file


def _resume(tmp_path, name: str, nproc: int, load, at: int, *flags: str) -> tuple[dict[int, float], list[str]]:
    """``RUN`` with ``flags`` on ``nproc`` ranks, resumed from ``load``'s iteration ``at``: its losses and its --load lines."""
    (load / TRACKER).write_text(str(at))
    out = torchrun(nproc, *RUN, *flags, "--load", str(load), "--epp-metrics", str(tmp_path / f"{name}.jsonl")).stdout
    assert f"resumed at iteration {at}" in out, out[-3000:]
    return _losses(tmp_path / f"{name}.jsonl"), [line[2:] for line in out.splitlines() if line.startswith(f"> --load {load}")]


def _equal_losses(got: dict[int, float], ref: dict[int, float], first: int) -> None:
    assert sorted(got) == list(range(first, ITERS + 1)), got
    assert all(math.isclose(got[i], ref[i], rel_tol=TOLERANCE) for i in got), (got, ref)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run at pp 2: its losses by iteration and its checkpoint directory (iterations 3 and 5)."""
    tmp = tmp_path_factory.mktemp("reshard")
    torchrun(2, *RUN, FULLY, "--save", str(tmp / "ref"), "--save-interval", "3", "--epp-metrics", str(tmp / "ref.jsonl"))
    losses = _losses(tmp / "ref.jsonl")
    assert sorted(losses) == list(range(1, ITERS + 1))
    return losses, tmp / "ref"


def _notes(load, at: int, saved: str, now: str, planner: str) -> list[str]:
    return [f"--load {load}: iteration {at} was saved at {saved}, this run is at {now}: the model and optimizer states "
            f"resharded; the data stream goes on at sample {8 * at}, split over this run's data-parallel replicas",
            f"--load {load}: iteration {at}: the random generators restart from --seed 1234 and iteration {at} (their saved "
            "states are per rank of another layout)",
            f"--load {load}: iteration {at}: the planner's calibration {planner}"]


def test_pp2_resumes_at_pp1_dp2_then_at_dp1(reference, tmp_path):
    """pp 2 -> pp 1 x dp 2 (saving its optimizer in the dp_reshardable default) -> dp 1: the losses of the reference;
    the planner's calibration restarts at the new stages and carries over a change of dp alone; the dp_reshardable
    checkpoint at another tp is one line naming the flag that saves a reshardable one."""
    ref, ckpt = reference
    dp2, notes = _resume(tmp_path, "dp2", 2, ckpt, 3, *PP1, "--save", str(tmp_path / "dp2"), "--save-interval", "4")
    _equal_losses(dp2, ref, 4)
    assert notes == _notes(ckpt, 3, "pp 2, dp 1", "pp 1, dp 2", "restarts from the profile (fitted to the stages of pp 2)"), notes
    with pytest.raises(ArgumentError) as refused:
        check_loadable(parse_config([*RUN[1:], *PP1, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "128",
                                     "--load", str(tmp_path / "dp2")], world_size=2))
    assert str(refused.value) == (
        f"pretrain_gpt.py: error: --load {tmp_path / 'dp2'}: iteration 5 was saved with tp 1, dp 2 and the distributed optimizer's states in "
        "megatron-core's dp_reshardable format, which reshards over the data- and context-parallel sizes only; this run has tp 2, dp 1 (save "
        "with --dist-ckpt-optim-fully-reshardable to change the other sizes, or --no-load-optim to load the model alone)")
    dp1, notes = _resume(tmp_path, "dp1", 1, tmp_path / "dp2", 4, *PP1)
    _equal_losses(dp1, ref, 5)
    assert notes == _notes(tmp_path / "dp2", 4, "dp 2", "dp 1", "carries over (every pipeline stage as saved)"), notes
    # dp 2 -> cp 2: the distributed optimizer shards over DP x CP, so its dp_reshardable states move to context parallelism
    cp2, notes = _resume(tmp_path, "cp2", 2, tmp_path / "dp2", 4, *PP1, "--context-parallel-size", "2")
    _equal_losses(cp2, ref, 5)
    assert notes[0].startswith(f"--load {tmp_path / 'dp2'}: iteration 4 was saved at dp 2, cp 1, this run is at dp 1, cp 2: the model "
                               "and optimizer states resharded"), notes


def test_pp2_resumes_at_tp2_whose_states_load_at_tp1_bit_for_bit(reference, tmp_path):
    """pp 2 -> pp 1 x tp 2 (the optimizer fully_reshardable): the losses of the reference. Its iteration 4 loaded at
    tp 1 and saved at once (no step): every model and optimizer tensor of the checkpoint, as the global tensor
    dist_checkpointing holds, equals the tp 2 run's bit for bit. A tp whose vocabulary padding differs is one line
    naming the --make-vocab-size-divisible-by that pads alike."""
    ref, ckpt = reference
    tp2 = [*PP1, "--tensor-model-parallel-size", "2"]
    (ckpt / TRACKER).write_text("3")
    with pytest.raises(ArgumentError) as refused:
        check_loadable(parse_config([*RUN[1:], *tp2, "--make-vocab-size-divisible-by", "512", "--load", str(ckpt)], world_size=2))
    assert str(refused.value) == (f"pretrain_gpt.py: error: --load {ckpt}: iteration 3 has its vocabulary padded to 512 rows, this run pads it to 1024 "
                                  "(--make-vocab-size-divisible-by 512 x tp 2): a different model shape (the padded rows enter "
                                  "the softmax); --make-vocab-size-divisible-by 256 pads it to 512 at tp 2"), refused.value
    got, notes = _resume(tmp_path, "tp2", 2, ckpt, 3, *tp2, "--make-vocab-size-divisible-by", "128", FULLY,
                         "--save", str(tmp_path / "tp2"), "--save-interval", "4")
    _equal_losses(got, ref, 4)
    assert notes == _notes(ckpt, 3, "pp 2, tp 1", "pp 1, tp 2", "restarts from the profile (fitted to the stages of pp 2, tp 1)")
    got, notes = _resume(tmp_path, "tp1", 1, tmp_path / "tp2", 4, *PP1, FULLY, "--train-iters", "4", "--save", str(tmp_path / "tp1"))
    assert got == {} and notes[0].startswith(f"--load {tmp_path / 'tp2'}: iteration 4 was saved at tp 2, this run is at tp 1: "), notes
    tensors = []
    for name, path in (("tp2", tmp_path / "tp2" / "iter_0000004"), ("tp1", tmp_path / "tp1" / "iter_0000004")):
        dcp_to_torch_save(path, tmp_path / f"{name}.pt")
        tensors.append({k: v for k, v in torch.load(tmp_path / f"{name}.pt", weights_only=False).items() if isinstance(v, torch.Tensor)})
    saved, resharded = tensors
    assert saved.keys() == resharded.keys()
    optimizer = [k for k in saved if k.startswith("optimizer.state.exp_avg")]
    assert len(optimizer) == 2 * sum(1 for k in saved if k.startswith(("decoder.", "embedding.", "output_layer."))), sorted(saved)
    assert all(saved[k].abs().sum() > 0 for k in optimizer)
    assert [k for k in saved if not torch.equal(saved[k], resharded[k])] == []


def test_every_checkpoint_file_is_hashed_by_exactly_one_rank_at_any_world_size():
    """A checkpoint written by 4 ranks, verified by 1 to 6: every file by exactly one rank (the shards of a writer
    rank the loading world lacks too), the writer's own where it exists."""
    files = [f"__{r}_{k}.distcp" for r in range(4) for k in range(2)] + [".metadata", "common.pt", "metadata.json"]
    for world_size in range(1, 7):
        owners = {name: [rank for rank in range(world_size) if hashed_by(name, rank, world_size)] for name in files}
        assert all(len(ranks) == 1 for ranks in owners.values()), (world_size, owners)
        assert all(owners[f"__{r}_0.distcp"] == [r] for r in range(min(4, world_size)))
