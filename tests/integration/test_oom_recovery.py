"""An out-of-memory error in a step costs a re-plan, not the run (pretrain_gpt.py --elastic-pp, torchrun, CPU).

The test-only ``EPP_FAULT_INJECT=oom@ITERATION:RANK:OP[:CHUNK]`` raises ``torch.OutOfMemoryError`` on one rank
before a forward (``F``), a backward (``B``) or a recomputing layer's forward (``R``) of the first run of that
iteration's batch. Every rank abandons the step (no rank waits in a send/receive or a collective: a hang fails the
test by its timeout), the gradients are zeroed, the RNG states restored, the activation memory factor raised and
the batch planned again and run again: the run's losses, learning rates, consumed samples and final weights and
Adam moments equal those of the run without the fault (bit for bit where the plan is the same; within fp32
rounding where the raised factor changes it), at pp 2 and at dp 2, for the elastic and the Megatron-packing
builder. After :data:`~megatron_epp.training.elastic.OOM_TRIES` failed plans of one batch the run stops with one
line naming an ``--epp-memory-budget`` to try.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_epp.planner.online import OOM_FACTOR_STEP
from megatron_epp.training.elastic import OOM_TRIES
from megatron_epp.training.metrics import read_metrics
from tests.launch import torchrun

ITERS = 4
BASE = ["pretrain_gpt.py", "--elastic-pp", "--mock-data", "--num-layers", "4", "--hidden-size", "32", "--global-batch-size", "8",
        "--lr", "5e-3", "--lr-warmup-iters", "2", "--train-iters", str(ITERS), "--log-interval", "1", "--epp-calibrate-interval", "0"]
PP2 = ["--pipeline-model-parallel-size", "2"]
DP2 = ["--pipeline-model-parallel-size", "1"]
# iteration 3's elastic plan has split chunks and recomputes at 2048 tokens and 8 MB, and the raised memory factor
# changes the plans (more recompute); at 512 tokens and 1 GB memory shapes no plan, and the plan run again is the same
BINDING = ["--seq-length", "2048", "--epp-memory-budget", "0.008"]
LOOSE = ["--seq-length", "512", "--epp-memory-budget", "1"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
TIMEOUT_S = 180  # a rank left waiting for another would hang: the launch fails by this


def launch(tmp_path, name: str, *flags: str, fault: str | None = None, check: bool = True):
    """One run of ``flags``, saved at its end: (its output, its training records, its final state as one dict)."""
    save, metrics = tmp_path / name, tmp_path / f"{name}.jsonl"
    env = {"EPP_FAULT_INJECT": fault} if fault else None
    proc = torchrun(2, *BASE, *flags, "--save", str(save), "--epp-metrics", str(metrics), env=env, check=check, timeout=TIMEOUT_S)
    if not check and proc.returncode != 0:
        return proc, None, None
    records = [m for m in read_metrics(metrics) if m.kind == "train"]
    dcp_to_torch_save(str(save / f"iter_{ITERS:07d}"), str(tmp_path / f"{name}.pt"))
    return proc, records, torch.load(tmp_path / f"{name}.pt", weights_only=False)


def flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Model weights and Adam moments of a saved state by global name."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() and (
                f"{prefix}{key}".startswith(("decoder.", "embedding.", "output_layer.", "optimizer.state.exp_avg"))):
            out[f"{prefix}{key}"] = value
    return out


def assert_same_run(expected, got, rtol: float, out: str) -> None:
    """Losses, learning rates, consumed samples, and the final weights and Adam moments: equal (rtol 0: bit for bit)."""
    (_, ref_records, ref_state), (_, records, state) = expected, got
    assert [m.iteration for m in records] == list(range(1, ITERS + 1)), out[-3000:]  # no iteration skipped or doubled
    assert [m.consumed_samples for m in records] == [m.consumed_samples for m in ref_records]
    assert [m.lr for m in records] == [m.lr for m in ref_records]
    np.testing.assert_allclose([m.loss for m in records], [m.loss for m in ref_records], rtol=rtol, atol=0)
    ref, mine = flat(ref_state), flat(state)
    assert ref.keys() == mine.keys() and len(ref) > 10
    for name in ref:
        torch.testing.assert_close(mine[name], ref[name], rtol=rtol, atol=rtol * 1e-2, msg=name)


class References:
    """The runs without a fault, each launched when a test first needs it: ``dropout`` (pp 2, dropout, the loose
    budget), ``pp2`` and ``dp2`` (no dropout, the binding budget; the elastic builder). The initial weights depend on
    the pipeline layout (each stage seeds its own layers), so a data-parallel run has a reference of its own."""

    FLAGS = {"dropout": [*PP2, *LOOSE, *DROPOUT], "pp2": [*PP2, *BINDING], "dp2": [*DP2, *BINDING]}

    def __init__(self, tmp) -> None:
        self.tmp, self.runs = tmp, {}

    def __getitem__(self, name: str):
        if name not in self.runs:
            self.runs[name] = launch(self.tmp, name, *self.FLAGS[name])
        return self.runs[name]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return References(tmp_path_factory.mktemp("oom_reference"))


def recovered(out: str, iteration: int, stage: int, op: str) -> None:
    """The one line of a recovery: the iteration, the stage, the op, the peak and the new factor."""
    line = next((l for l in out.splitlines() if f"iteration {iteration}: out of memory on stage {stage}" in l), None)
    assert line is not None, out[-4000:]
    assert f"in the {op} of chunk" in line and "activation peak" in line, line
    assert re.search(r"activation memory factor 1\.000 -> 1\.\d{3}, the batch planned again .*try 2 of", line), line


def test_same_plan_again_is_bit_identical_with_dropout(tmp_path, references):
    """pp 2, the first stage runs out of memory in iteration 3 in its second backward (the first chunk's gradients
    already accumulated on both stages) under a loose budget: the batch runs again on the same plan from zeroed
    gradients, drawing the same dropout masks (the RNG states restored), so the run is the faultless one bit for
    bit; also that iteration's record says it was planned again."""
    got = launch(tmp_path, "fault", *PP2, *LOOSE, *DROPOUT, fault="oom@3:0:B:1")  # after chunk 0's backward on both stages
    recovered(got[0].stdout, 3, 0, "backward")
    assert [m.elastic.oom_retries for m in got[1]] == [0, 0, 1, 0]
    assert_same_run(references["dropout"], got, 0.0, got[0].stdout)


@pytest.mark.parametrize("builder, layout, fault, stage, op", [
    ("elastic", PP2, "oom@3:1:B:split", 1, "backward"),  # a split slice's backward: K/V buffers and their gradients held
    ("elastic", PP2, "oom@3:0:T", 0, "transfer"),  # a receive buffer: the transfer is made again once memory is released
    ("megatron", PP2, "oom@3:1:R", 1, "recompute"),  # Megatron packing's plan, in a recomputing layer's forward
    ("elastic", DP2, "oom@3:1:F", 0, "forward"),  # data parallel: one replica fails, both run the batch again
])
def test_recovers_and_trains_as_without_the_fault(tmp_path, references, builder, layout, fault, stage, op):
    """Under a binding budget the raised factor changes the plan (more recompute): the run equals the faultless
    elastic run of its layout within fp32 rounding (EPP's loss does not depend on the plan or the builder)."""
    got = launch(tmp_path, "fault", *layout, *BINDING, "--epp-plan", builder, fault=fault)
    iteration = int(fault.split("@")[1].split(":")[0])
    recovered(got[0].stdout, iteration, stage, op)
    assert got[1][iteration - 1].elastic.oom_retries == 1
    assert_same_run(references["dp2" if layout is DP2 else "pp2"], got, 2e-5, got[0].stdout)


def test_gives_up_with_one_line_after_the_last_plan(tmp_path):
    """A batch that runs out of memory on every plan: the run stops after OOM_TRIES plans with one error line that
    names the budget to try, on every rank alike (exit 1, no hang)."""
    proc, _, _ = launch(tmp_path, "every", *PP2, *BINDING, fault="oom_every@2:1:F", check=False)  # stops in iteration 2
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"on each of {OOM_TRIES} plans of this batch" in errors[0], errors[0]
    assert proc.stdout.count("iteration 2: out of memory on stage 1") == OOM_TRIES - 1, proc.stdout[-3000:]
    # the figures that hold: the factor the log raised it to last (1.0 -> 1.2 -> 1.44 -> 1.728 ...), the budget as given
    raised = re.findall(r"activation memory factor [0-9.]+ -> ([0-9.]+)", proc.stdout)
    assert len(raised) == OOM_TRIES - 1 and float(raised[-1]) > 1.0, proc.stdout[-3000:]
    now = float(re.search(r"\(activation memory factor now ([0-9.]+)\)", errors[0]).group(1))  # raised once more by the last
    assert now >= round(float(raised[-1]) * OOM_FACTOR_STEP, 3), errors[0]
    assert errors[0].endswith("--epp-memory-budget 0.0064 (now 0.008)"), errors[0]
