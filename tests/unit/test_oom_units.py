"""The pieces of out-of-memory recovery and of the allocator-true memory measurement that need no launch: the
planner's factor after an out-of-memory error, the requested bytes read from CUDA's message, the fault spec, the
CUDA allocator's configuration, and the timed span that starts after the memory tracker's synchronisation (the
launched recovery is tests/integration/test_oom_recovery.py)."""

from __future__ import annotations

import contextlib
import time
import types

import numpy as np
import pytest
import torch

from megatron_epp.base.units import GIB
from megatron_epp.executor import schedule
from megatron_epp.executor.schedule import OpFailure, requested_bytes
from megatron_epp.planner.calibration import activation_bytes
from megatron_epp.planner.online import OOM_FACTOR_STEP
from megatron_epp.training import elastic
from megatron_epp.config.errors import ArgumentError
from megatron_epp.training.faults import FAULT_ENV, FaultInjection
from megatron_epp.model.runtime import ALLOC_CONF, ALLOC_DEFAULT, configure_cuda_allocator
from tests.unit.test_planner_calibration import plan_builder

LENGTHS = [700, 300, 120, 90, 64, 40, 33, 17]


@pytest.mark.parametrize("interval", [0, 5])
def test_an_out_of_memory_raises_the_factor_from_the_measured_peak_whatever_the_calibration(interval):
    """The factor becomes the larger of the failing stage's measured / raw-predicted activation peak and the old
    factor x OOM_FACTOR_STEP, with --epp-calibrate-interval 0 too; the next step's model is the new one (so a plan
    made ahead is made again), and a later refit never goes below it (it is the ratio's floor)."""
    planner = plan_builder(interval, budget_gb=0.01)
    plan = planner(LENGTHS).plan
    raw = activation_bytes(plan, planner.raw_model)
    old_model = planner.cost_model
    assert planner.observe_oom(plan, {1: 1.7 * raw[1]}) == pytest.approx(1.7)  # the measurement above the step
    assert planner.memory_factor == pytest.approx(1.7) and planner.next_step_memory_factor == pytest.approx(1.7)
    assert planner.cost_model is not old_model and planner.next_step_model is planner.cost_model
    assert planner.memory_ratio == pytest.approx(1.7)
    assert planner.observe_oom(plan, {0: 0.5 * raw[0]}) == pytest.approx(1.7 * OOM_FACTOR_STEP)  # early failure: the step
    assert planner.observe_oom(plan, {}) == pytest.approx(1.7 * OOM_FACTOR_STEP**2)  # another replica failed
    again = planner(LENGTHS).plan
    assert np.all(activation_bytes(again, planner.cost_model) <= planner.config.memory_budget_bytes)
    assert again.recomputed_layers() > plan.recomputed_layers()  # the plan made again fits a larger need


def test_the_requested_bytes_come_from_cudas_message():
    assert requested_bytes("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity") == 2 * GIB
    assert requested_bytes("Tried to allocate 512.00 MiB (GPU 0; 79.1 GiB total)") == 512 * 2**20
    assert requested_bytes("CUDA out of memory (planted)") is None
    failure = OpFailure(1, 0, 3, "split", 4096, "backward", "x", None)
    assert failure.describe() == "the backward of chunk 3 (split, 4096 tokens) of pipeline 0"


@pytest.mark.parametrize("spec, expected", [
    ("oom@3:1:B", FaultInjection("oom", 3, 1, "B", None)),
    ("oom@3:0:F:2", FaultInjection("oom", 3, 0, "F", 2)),
    ("oom@4:1:R:split", FaultInjection("oom", 4, 1, "R", "split")),
    ("oom_every@2:1:T", FaultInjection("oom_every", 2, 1, "T", None)),
    ("nan_grad@5:1", FaultInjection("nan_grad", 5, 1)),
    ("nan_loss@5", FaultInjection("nan_loss", 5, 0)),
])
def test_fault_specs(monkeypatch, spec, expected):
    monkeypatch.setenv(FAULT_ENV, spec)
    assert FaultInjection.from_env() == expected


@pytest.mark.parametrize("spec", ["oom@3:1:X", "nan_loss@3:1:B", "oom@3:1:B:2:9", "oom@x"])
def test_bad_fault_specs_are_one_line(monkeypatch, spec):
    monkeypatch.setenv(FAULT_ENV, spec)
    with pytest.raises(ArgumentError, match="expected KIND@ITERATION"):
        FaultInjection.from_env()


def test_the_planted_oom_fires_once_where_asked_and_every_run_with_oom_every():
    layout = types.SimpleNamespace(chunk=types.SimpleNamespace(id=2, kind="split"))
    other = types.SimpleNamespace(chunk=types.SimpleNamespace(id=1, kind="batched"))
    hook = FaultInjection("oom", 3, 1, "B", "split").oom_hook(3, 1, attempt=1)
    hook("F", layout)  # not its op
    hook("B", other)  # not its chunk
    with pytest.raises(torch.OutOfMemoryError, match="planted"):
        hook("B", layout)
    hook("B", layout)  # once
    assert FaultInjection("oom", 3, 1, "B").oom_hook(3, 1, attempt=2) is None  # the batch's run again is clean
    assert FaultInjection("oom", 3, 1, "B").oom_hook(3, 0, attempt=1) is None  # another rank
    assert FaultInjection("oom_every", 3, 1, "B").oom_hook(3, 1, attempt=4) is not None


def test_cuda_allocator_gets_expandable_segments_unless_the_user_chose():
    env: dict[str, str] = {}
    line = configure_cuda_allocator(env, cuda=True)
    assert env == {ALLOC_CONF: ALLOC_DEFAULT} and "set by pretrain_gpt.py" in line
    env = {ALLOC_CONF: "max_split_size_mb:512"}
    line = configure_cuda_allocator(env, cuda=True)
    assert env == {ALLOC_CONF: "max_split_size_mb:512"} and "as set in the environment" in line
    env = {}
    assert configure_cuda_allocator(env, cuda=False) is None and env == {}


def test_main_configures_the_allocator_before_anything_else(monkeypatch):
    """Even a run refused at its first check has set it: main does it first, before any CUDA call could start the allocator."""
    from megatron_epp.training import main
    from megatron_epp.model import runtime as initialize
    from megatron_epp.config.parser import parse_config
    monkeypatch.delenv(ALLOC_CONF, raising=False)
    cfg = parse_config(["--mock-data", "--load", "/nonexistent/ck", "--exit-on-missing-checkpoint"], world_size=1)
    monkeypatch.setattr(initialize.torch.cuda, "is_available", lambda: True)
    assert main.main(cfg) == 2
    import os
    assert os.environ.get(ALLOC_CONF) == ALLOC_DEFAULT


class SlowTracker:
    """A memory tracker whose entry waits as CUDA's synchronize waits for the previous optimizer step."""

    def __init__(self, device, context) -> None:
        self.peak_bytes = self.peak_allocated = 0

    def __enter__(self):
        time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        return None


def test_the_timed_span_starts_after_the_trackers_synchronisation(monkeypatch):
    """The step's span (what the time model calibrates on) leaves out the tracker's entry (the device synchronisation:
    the tail of the previous optimizer step on CUDA)."""
    monkeypatch.setattr(elastic, "ActivationMemoryTracker", SlowTracker)
    monkeypatch.setattr(elastic, "forward_backward_elastic", lambda **kwargs: time.sleep(0.05) or [])
    monkeypatch.setattr(elastic.ChunkContext, "of", staticmethod(lambda model: types.SimpleNamespace(fault_hook=None)))
    step = object.__new__(elastic.ElasticTrainStep)
    step.model, step.iteration, step.groups = object(), 1, None
    step.runtime = types.SimpleNamespace(device=torch.device("cpu"), rank=0)
    step.faults = FaultInjection()
    inputs = types.SimpleNamespace(batches=[], views=[])
    plan = types.SimpleNamespace(pipelines=[])
    _, ms = step._run(plan, inputs, forward_only=False, attempt=1)
    assert 40 <= ms < 250, ms


def test_on_cuda_each_step_starts_from_an_emptied_cache_and_measures_reserved_and_allocated(monkeypatch):
    """The tracker's CUDA protocol (functions of torch.cuda stood in, in the order called): synchronize, empty the cache
    (the step's reserved peak is then its own: without it an H200 run's reserved peak held earlier steps' cache and the
    memory factor ran away, memory_tracker's doc), reset the peaks, read the start; at the end the reserved peak is
    what the planner calibrates on (peak_bytes), the allocated peak beside it."""
    from megatron_epp.executor import memory_tracker
    calls: list[str] = []
    values = {"memory_allocated": 100, "max_memory_allocated": 300, "max_memory_reserved": 350}
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats", *values):
        monkeypatch.setattr(memory_tracker.torch.cuda, name, lambda *a, name=name: calls.append(name) or values.get(name))
    with memory_tracker.ActivationMemoryTracker(torch.device("cuda"), context=None) as tracker:
        assert calls == ["synchronize", "empty_cache", "reset_peak_memory_stats", "memory_allocated"]
    assert (tracker.peak_bytes, tracker.peak_allocated) == (250, 200)


def test_the_give_up_line_gives_each_figure_at_the_precision_it_needs():
    """The line that stops a run: the factor as the log prints it, the run's budget and a lower one to try, neither
    rounded to nothing (a planted ``:.1f`` gave "--epp-memory-budget 0 (now 0.0)" for a budget of 0.008 GB)."""
    from megatron_epp.training.elastic import give_up_line

    line = give_up_line("iteration 2: out of memory on stage 1", 1.728, 0.008 * GIB)
    assert line.endswith("(activation memory factor now 1.728): lower the memory budget, e.g. --epp-memory-budget 0.0064 (now 0.008)")
    assert give_up_line("x", 2.0736, 80 * GIB).endswith("factor now 2.074): lower the memory budget, e.g. --epp-memory-budget 64 (now 80)")
    assert give_up_line("x", 1.2, 73.14 * GIB).endswith("--epp-memory-budget 58 (now 73.14)")
