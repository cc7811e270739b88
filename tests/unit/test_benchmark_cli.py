"""Bad input to a benchmark or a tool is answered as ``pretrain_gpt.py`` answers it: one line ``PROG: error: ...`` on
stderr and exit status 2, never a traceback. Each command line is parsed in-process (``main([...])``), nothing runs."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

import pytest

from benchmarks.common import positive_ints, subset_of


def one_line_error(capsys, call: Callable[[], object]) -> str:
    """``call``'s refusal: it exits with status 2 after one line on stderr, ``PROG: error: ...``; that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        call()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, (exit_.value.code, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and ": error: " in err, err
    return err.strip()


BAD = [  # (module, argv, what the line says): a value of the wrong kind for each benchmark's command line
    ("bench_context_parallel", ["--repeats", "three"], "argument --repeats: invalid int value: 'three'"),
    ("bench_offload", ["--repeats", "three"], "argument --repeats: invalid int value: 'three'"),
    ("bench_elastic", ["--seq1f1b-k", "2,x"], "argument --seq1f1b-k: '2,x': expected comma-separated integers"),
    ("bench_gpu", ["--cells", "mock:32Q"], "--cells: 'mock:32Q': expected DATA:CAP"),
    ("bench_planner", ["--seeds", "many"], "argument --seeds: invalid int value"),
    ("bench_planning_placement", ["--configs", "main-job,nope"], "--configs: unknown nope"),
    ("bench_recompute", ["--iters", "8.5"], "argument --iters: invalid int value"),
    ("calibrate_step", ["--configs", "nope"], "argument --configs: 'nope': unknown nope"),
    ("check_cuda_attention", ["--slice-tokens", "8K"], "argument --slice-tokens: invalid int value: '8K'"),
    ("cost_model_accuracy", ["--per-kind", "x"], "argument --per-kind: invalid int value"),
    ("gpu_check_report", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ("layer_host_time", ["--layers", "x"], "argument --layers: invalid int value"),
    ("paper_grid", ["--caps", "48K,96Q"], "argument --caps: '48K,96Q': expected comma-separated integers"),
    ("paper_grid", ["--data", "github,c4"], "argument --data: 'github,c4': unknown c4"),
    ("paper_grid", ["--models", "llama-7b,gpt-5"], "argument --models: 'llama-7b,gpt-5': unknown gpt-5"),
    ("paper_grid", ["--clusters", "a800"], "argument --clusters: 'a800': unknown a800"),
    ("paper_grid_cp", ["--cells", "c.jsonl", "--rows", "github:llama-7b:big:a800-ib-gpu"], "argument --rows: 'big'"),
    ("paper_grid_cp", ["--cells", "c.jsonl", "--rows", "github:llama-7b"], "argument --rows: 'github:llama-7b': expected"),
    ("profile_executor", ["--chunks", "x"], "argument --chunks: invalid int value"),
    ("profile_layer", ["--repeats", "x"], "argument --repeats: invalid int value"),
    ("time_model_accuracy", ["--configs", "nope"], "argument --configs: 'nope': unknown nope"),
]


@pytest.mark.parametrize(("name", "argv", "says"), BAD, ids=[f"{b[0]}{b[1][-2:]}" for b in BAD])
def test_a_benchmark_refuses_bad_input_in_one_line(name, argv, says, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [f"/repo/benchmarks/{name}.py"])  # as `python -m benchmarks.NAME` runs it
    module = importlib.import_module(f"benchmarks.{name}")
    line = one_line_error(capsys, lambda: module.main(argv))
    assert line.startswith(f"{name}.py: error: ") and says in line, line


@pytest.mark.parametrize(("module", "prog", "argv", "says"), [
    ("megatron_epp.data.prepare", "epp-prepare-data", ["--input", "a.txt", "--output-prefix", "o", "--workers", "two"],
     "argument --workers: invalid int value"),
    ("megatron_epp.measure.profile_gpu", "epp-profile-gpu", ["--device", "cpu", "--seq-lengths", "16,x"],
     "argument --seq-lengths: '16,x': expected comma-separated integers"),
])
def test_a_tool_refuses_bad_input_with_one_error_line(module, prog, argv, says, capsys):
    """The tools (entry points) keep argparse's usage block above the one error line, as ``epp-plan`` does."""
    main = importlib.import_module(module).main
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert errors == [err.strip().splitlines()[-1]] and errors[0].startswith(f"{prog}: error: {says}"), err


def test_list_types():
    assert positive_ints("48K,98304") == [49152, 98304]
    for bad in ("", "0", "4,-1", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_ints(bad)
    assert subset_of(("a", "b"))("b,a") == ["b", "a"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown c"):
        subset_of(("a", "b"))("a,c")
