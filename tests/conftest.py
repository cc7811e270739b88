"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
from hypothesis import settings

import pretrain_gpt
from megatron_epp.training import main as training_main
from megatron_epp.config import memory_budget
from tests import host

# The property tests draw the same examples on every run and machine (a suite that passes, passes again: CI never meets
# a new counterexample by chance); HYPOTHESIS_PROFILE=explore draws new ones (and keeps those that fail in .hypothesis/).
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@pytest.fixture(autouse=True)
def fixed_memory_reading(monkeypatch):
    """Every in-process test reads :data:`tests.host.MEMORY` as its device's memory, never this machine's: a default
    budget (and every figure derived from it) is the same on any host. A test of the reading itself imports the real
    :func:`~megatron_epp.config.memory_budget.read_memory` at its module's import."""
    monkeypatch.setattr(memory_budget, "read_memory", lambda: host.MEMORY)


@pytest.fixture
def pretrain_in_process(monkeypatch, capsys):
    """``pretrain_gpt.py FLAGS`` through its own entry point (``pretrain_gpt.run``) in this process, answered as
    :func:`tests.integration.test_bad_input_process.run_pretrain` answers (exit status, stdout, stderr) without a process start and
    megatron-core's import per case (seconds each). A warning raised on the way is added to stderr as Python's default
    filters would print it to a user (as the process would show it). Flags that get past every check stop where the
    process group would start, and fail the test: a bad flag must be refused before that."""

    def accepted(args):
        raise AssertionError("the flags were accepted: pretrain_gpt.py went on to start its process group")

    monkeypatch.setattr(training_main, "initialize", accepted)

    def run(*flags: str, world_size: int = 1) -> subprocess.CompletedProcess:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
        capsys.readouterr()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=hidden)  # Python's default filters hide these from a user
            try:
                returncode = pretrain_gpt.run()
            except SystemExit as exit_:  # argparse's --help
                returncode = exit_.code
        out, err = capsys.readouterr()
        err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
        return subprocess.CompletedProcess(sys.argv, returncode, out, err)

    return run
