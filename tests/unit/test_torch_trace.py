"""``--profile`` (``training/torch_trace.py``) and the schedule's named ranges (``executor/schedule.py``).

The flags are validated before any work, with Megatron-LM's defaults filled in. ``trace_schedule``'s
``(wait, warmup, active)``, fed to torch's own ``torch.profiler.schedule`` and stepped once before each iteration,
records exactly the iterations ``[start, end)`` (fresh and resumed runs). In process: torch.profiler records the
window's iterations and nothing else and names its trace file; the nsys path calls ``cudaProfilerStart`` before
the window's first iteration and ``cudaProfilerStop`` after its last (a fake cudart on CPU), and on CPU calls
nothing. The elastic schedule names each forward and backward (pipeline, chunk, kind, tokens, stage, recompute)
while a profiler records, and builds no range when none does.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_epp.executor import schedule
from megatron_epp.plan.order import stage_ops
from megatron_epp.base.dims import ParallelDims
from megatron_epp.config.parser import parse_config
from megatron_epp.config.errors import ArgumentError
from megatron_epp.model.runtime import Runtime
from megatron_epp.training.torch_trace import TorchTrace, startup_note, trace_of, trace_schedule
from tests.unit.test_chunk_context import CHUNKS, PLAN, model, step  # noqa: F401  (the model fixture)

CPU = torch.device("cpu")


def config(*flags: str, train_iters: int = 6):
    return parse_config(["--mock-data", "--train-iters", str(train_iters), *flags], world_size=2)


def runtime(rank: int = 0, device: torch.device = CPU) -> Runtime:
    return Runtime(device, rank=rank, pp_rank=rank, tp_rank=0, dp_rank=0, dims=ParallelDims(1, 2, 1))


def test_megatron_lm_defaults_fill_in():
    cfg = config("--profile", train_iters=20)
    assert (cfg.profile.enabled, cfg.profile.step_start, cfg.profile.step_end, cfg.profile.ranks) == (True, 10, 12, (0,))
    cfg = config("--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--profile-ranks", "1", "0",
                 "--use-pytorch-profiler", "--tensorboard-dir", "tb")
    assert (cfg.profile.step_start, cfg.profile.step_end, cfg.profile.ranks, cfg.profile.use_pytorch_profiler) == (4, 6, (1, 0), True)
    off = config()
    assert (off.profile.enabled, off.profile.step_start, off.profile.ranks) == (False, None, None)


@pytest.mark.parametrize("flags, message", [
    (["--profile-step-start", "4"], "--profile-step-start needs --profile"),
    (["--profile-ranks", "1"], "--profile-ranks needs --profile"),
    (["--use-pytorch-profiler", "--tensorboard-dir", "tb"], "--use-pytorch-profiler needs --profile"),
    (["--profile", "--profile-step-start", "-1", "--profile-step-end", "2"], "--profile-step-start -1: must be >= 0"),
    (["--profile", "--profile-step-start", "4", "--profile-step-end", "4"],
     "--profile-step-end 4 must be larger than --profile-step-start 4"),
    (["--profile", "--profile-step-start", "5", "--profile-step-end", "3"], "--profile-step-end 3 must be larger"),
    (["--profile", "--profile-step-start", "7", "--profile-step-end", "9"],
     "--profile-step-start 7 --profile-step-end 9: no iteration to profile (the run trains iterations 1 to 6"),
    (["--profile", "--profile-step-start", "0", "--profile-step-end", "1"], "no iteration to profile"),
    (["--profile"], "--profile-step-start 10 --profile-step-end 12: no iteration to profile"),  # the defaults, 6 iterations
    (["--profile", "--profile-step-start", "1", "--profile-ranks", "0", "2"], "--profile-ranks 2: no such rank (the ranks are 0 to 1)"),
    (["--profile", "--profile-step-start", "1", "--profile-ranks", "-1"], "--profile-ranks -1: no such rank"),
    (["--profile", "--profile-step-start", "1", "--use-pytorch-profiler"],
     "--use-pytorch-profiler writes its trace under --tensorboard-dir, as Megatron-LM: give --tensorboard-dir DIR"),
])
def test_bad_profile_flags_are_one_line_errors(flags, message):
    with pytest.raises(ArgumentError) as error:
        parse_config(["--mock-data", "--train-iters", "6", *flags], world_size=2)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_megatron_lm_schedule_arithmetic():
    assert trace_schedule(4, 6) == (3, 1, 2)  # upstream LLaMA-3's --profile-step-start 4 --profile-step-end 6
    assert trace_schedule(10, 12) == (9, 1, 2)
    assert trace_schedule(1, 3) == (0, 1, 2)
    assert trace_schedule(0, 2) == (0, 0, 2)
    assert trace_schedule(4, 6, resumed_at=2) == (1, 1, 2)
    assert trace_schedule(4, 6, resumed_at=4) == (0, 0, 2)  # iteration 5 left
    assert trace_schedule(4, 6, resumed_at=5) is None and trace_schedule(0, 1) is None


@pytest.mark.parametrize("start, end, resumed_at", [(s, e, r) for s in range(0, 5) for e in range(s + 1, 8) for r in range(0, 7)])
def test_torch_schedule_records_exactly_the_window(start, end, resumed_at):
    """Step k of the profiler runs iteration resumed_at + k (k = 0: started, before the first iteration)."""
    record = {torch.profiler.ProfilerAction.RECORD, torch.profiler.ProfilerAction.RECORD_AND_SAVE}
    expected = [i for i in range(max(start, resumed_at + 1), end)]
    arithmetic = trace_schedule(start, end, resumed_at)
    if arithmetic is None:
        assert expected == []
        return
    wait, warmup, active = arithmetic
    action = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1)
    assert [resumed_at + k for k in range(1, 20) if action(k) in record] == expected
    saved = [resumed_at + k for k in range(0, 20) if action(k) == torch.profiler.ProfilerAction.RECORD_AND_SAVE]
    assert saved == [end - 1]  # the trace is written when the next step begins


def run_iterations(trace: TorchTrace, iterations) -> None:
    for iteration in iterations:
        trace.step(iteration)
        with torch.profiler.record_function(f"iteration {iteration}"):
            torch.ones(2).sum()
    trace.close()


def trace_names(path) -> set[str]:
    return {event.get("name", "") for event in json.loads(path.read_text())["traceEvents"]}


@pytest.mark.parametrize("resumed_at, expected", [(0, [2, 3]), (2, [3])])
def test_torch_profiler_traces_the_window_and_names_its_file(tmp_path, capsys, resumed_at, expected):
    cfg = config("--profile", "--use-pytorch-profiler", "--tensorboard-dir", str(tmp_path), "--profile-step-start", "2",
                 "--profile-step-end", "4", "--profile-ranks", "0", "1")
    run_iterations(TorchTrace(cfg, runtime(1), resumed_at), range(resumed_at + 1, 7))
    traces = list(tmp_path.glob("*.pt.trace.json"))
    assert len(traces) == 1
    assert sorted(n for n in trace_names(traces[0]) if n.startswith("iteration ")) == [f"iteration {i}" for i in expected]
    assert capsys.readouterr().out == (f" profile: rank 1 wrote the torch.profiler trace of iterations {expected[0]} to 3 "
                                       f"to {traces[0]}\n")


def test_the_line_names_this_ranks_trace_while_another_rank_writes_beside_it(tmp_path, capsys, monkeypatch):
    """Two ranks write their traces into one --tensorboard-dir at the same time: the other rank's file still being
    written (``.tmp``, before its rename; seen on a loaded machine on 2026-11-29) or already finished is never the one
    this rank's line names (the planted fault, the newest new file of the directory, names the other's)."""
    real = torch.profiler.tensorboard_trace_handler

    def beside_another_rank(dir_name, worker_name=None, **kwargs):
        def handler(prof):
            real(dir_name, worker_name=worker_name, **kwargs)(prof)
            (tmp_path / "zz_other_rank.1.pt.trace.json.tmp").write_text("{}")  # sorts after this rank's file
            (tmp_path / "zz_other_rank.2.pt.trace.json").write_text("{}")
        return handler

    monkeypatch.setattr(torch.profiler, "tensorboard_trace_handler", beside_another_rank)
    cfg = config("--profile", "--use-pytorch-profiler", "--tensorboard-dir", str(tmp_path), "--profile-step-start", "2",
                 "--profile-step-end", "4")
    run_iterations(TorchTrace(cfg, runtime(0)), range(1, 5))
    (mine,) = [t for t in tmp_path.glob("*.pt.trace.json") if not t.name.startswith("zz_")]
    assert capsys.readouterr().out.endswith(f"to {mine}\n")
    assert not trace_of("host_1", "host_1.5.pt.trace.json.tmp") and not trace_of("host_1", "host_12.5.pt.trace.json")
    assert trace_of("host_1", "host_1.5.pt.trace.json") and trace_of("host_1", "host_1.5.pt.trace.json.gz")


def test_a_run_that_ends_inside_the_window_writes_its_trace(tmp_path, capsys):
    cfg = config("--profile", "--use-pytorch-profiler", "--tensorboard-dir", str(tmp_path), "--profile-step-start", "2",
                 "--profile-step-end", "6")
    run_iterations(TorchTrace(cfg, runtime(0)), range(1, 4))  # --exit-interval 3, say
    (trace,) = tmp_path.glob("*.pt.trace.json")
    assert sorted(n for n in trace_names(trace) if n.startswith("iteration ")) == ["iteration 2", "iteration 3"]
    assert "trace of iterations 2 to 3 to" in capsys.readouterr().out


def test_ranks_outside_profile_ranks_do_nothing(tmp_path):
    cfg = config("--profile", "--use-pytorch-profiler", "--tensorboard-dir", str(tmp_path), "--profile-step-start", "2")
    profiler = TorchTrace(cfg, runtime(1))
    run_iterations(profiler, range(1, 7))
    assert profiler.prof is None and list(tmp_path.iterdir()) == []


class FakeCudart:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def cudaProfilerStart(self):
        self.calls.append("cudaProfilerStart")

    def cudaProfilerStop(self):
        self.calls.append("cudaProfilerStop")


class FakeNvtx:
    def __init__(self, calls: list, **kwargs) -> None:
        self.calls, self.kwargs = calls, kwargs

    def __enter__(self):
        self.calls.append(f"emit_nvtx {self.kwargs}")

    def __exit__(self, *exc):
        self.calls.append("emit_nvtx end")


@pytest.fixture
def cuda_calls(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(calls))
    monkeypatch.setattr(torch.autograd.profiler, "emit_nvtx", lambda **kw: FakeNvtx(calls, **kw))
    return calls


def nsys_calls(calls: list, cfg, rt: Runtime, iterations, resumed_at: int = 0) -> list:
    trace = TorchTrace(cfg, rt, resumed_at)
    for iteration in iterations:
        trace.step(iteration)
        calls.append(iteration)
    trace.close()
    return calls


def test_nsys_capture_covers_the_window(cuda_calls):
    cfg = config("--profile", "--profile-step-start", "2", "--profile-step-end", "4")
    start, stop = ["cudaProfilerStart", "emit_nvtx {'record_shapes': True}"], ["emit_nvtx end", "cudaProfilerStop"]
    assert nsys_calls(cuda_calls, cfg, runtime(0, torch.device("cuda")), range(1, 7)) == [1, *start, 2, 3, *stop, 4, 5, 6]
    cuda_calls.clear()  # resumed inside the window: the rest of it; a run that ends inside it stops at the end
    assert nsys_calls(cuda_calls, cfg, runtime(0, torch.device("cuda")), range(3, 4), resumed_at=2) == [*start, 3, *stop]
    cuda_calls.clear()  # another rank, and a CPU: nothing
    assert nsys_calls(cuda_calls, cfg, runtime(1, torch.device("cuda")), range(1, 7)) == [1, 2, 3, 4, 5, 6]
    cuda_calls.clear()
    assert nsys_calls(cuda_calls, cfg, runtime(0), range(1, 7)) == [1, 2, 3, 4, 5, 6]


def test_startup_notes():
    nsys = config("--profile", "--profile-step-start", "4", "--profile-step-end", "6")
    assert startup_note(nsys, CPU) == ("profile: iterations 4 to 5 on rank 0 are marked for nsys (cudaProfilerStart/Stop, "
                                       "NVTX ranges): on cpu there is nothing for nsys to capture, training runs unprofiled "
                                       "(--use-pytorch-profiler records a torch.profiler trace)")
    assert "capture them with nsys profile --capture-range=cudaProfilerApi" in startup_note(nsys, torch.device("cuda"))
    assert "all before this run's first iteration 6 (resumed): nothing is profiled" in startup_note(nsys, CPU, resumed_at=5)
    torch_cfg = config("--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--profile-ranks", "0", "1",
                       "--use-pytorch-profiler", "--tensorboard-dir", "tb")
    assert startup_note(torch_cfg, CPU) == ("profile: torch.profiler records iterations 4 to 5 on ranks 0, 1 (record_shapes, "
                                            "with_stack); each rank writes its trace to tb (a line names it)")
    assert startup_note(config(), CPU) is None


def epp_ranges(events) -> list[str]:
    return [e.name for e in sorted(events, key=lambda e: e.time_range.start) if e.name.startswith("epp ")]


def test_the_schedule_names_each_op_while_a_profiler_records(model):  # noqa: F811
    """PLAN: one pipeline, a sequence split into three 4-token slices (the first recomputes one layer) and a batched
    chunk of 8 tokens, on stage 0 of 1."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(model)
    kinds = {pos: (c.kind, c.num_tokens) for pos, c in enumerate(CHUNKS)}
    expected = [f"epp {op.kind} p0 c{op.pos} {kinds[op.pos][0]} {kinds[op.pos][1]}t stage 0"
                + (" recompute 1" if (op.kind, op.pos) == ("B", 0) else "") for op in stage_ops(PLAN.pipelines[0], 0, 1)]
    assert epp_ranges(prof.events()) == expected
    assert expected[:3] == ["epp F p0 c0 split 4t stage 0", "epp F p0 c1 split 4t stage 0", "epp F p0 c2 split 4t stage 0"]
    assert "epp B p0 c0 split 4t stage 0 recompute 1" in expected and "epp F p0 c3 batched 8t stage 0" in expected


def test_no_range_is_built_while_no_profiler_records(model, monkeypatch):  # noqa: F811
    def no_range(name):
        raise AssertionError(f"a range was built with no profiler: {name}")

    monkeypatch.setattr(schedule.torch.profiler, "record_function", no_range)
    assert len(step(model)) == len(CHUNKS)

