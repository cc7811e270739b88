"""The flow `lengths -> planner -> Plan -> executor | simulator` holds in the imports.

import-linter checks the contracts in pyproject.toml (layers, torch-free planning, no cycles); the
torch-free packages are also imported for real, and a copy of the tree with a planted violation
must make the linter fail, so the check is known to bite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.paths import REPO

# the bottom package, the planning packages, and the lengths reader of data that the planner may import (lengths -> planner)
TORCH_FREE = ("megatron_epp.base", "megatron_epp.plan", "megatron_epp.cost", "megatron_epp.simulator", "megatron_epp.planner", "megatron_epp.data.lengths")


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
                          cwd=root, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})


def test_import_contracts_hold():
    out = lint(REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_planning_packages_import_without_torch():
    code = (
        "import importlib, pkgutil, sys\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    pkg = importlib.import_module(name)\n"
        "    for m in pkgutil.walk_packages(getattr(pkg, '__path__', []), name + '.'):\n"
        "        if not m.name.endswith('__main__'):\n"
        "            importlib.import_module(m.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'patches'))\n"
        "assert not bad, bad[:5]\n"
        "print(len([m for m in sys.modules if m.startswith('megatron_epp.')]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) >= 15  # every planning module was imported


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("megatron_epp/planner/chunking.py", "import torch", "never import torch"),
        ("megatron_epp/plan/order.py", "import megatron_epp.planner", "Layers"),
        ("megatron_epp/executor/spec.py", "import megatron_epp.cost.model", "never calls the planner"),
        ("megatron_epp/model/gpt.py", "import megatron_epp.training.main", "No import cycles"),
        ("megatron_epp/planner/online.py", "import megatron_epp.training.planning", "never import training"),
        ("megatron_epp/data/sequence_sampler.py", "import megatron_epp.planner.data_parallel", "Data never imports the planner"),
        ("megatron_epp/planner/cli.py", "import megatron_epp.data.documents", "never import torch"),  # only data's torch-free modules
        ("megatron_epp/base/dims.py", "import torch", "The bottom package base imports no other package"),
        ("megatron_epp/base/dims.py", "import megatron_epp.data.lengths", "The bottom package base imports no other package"),
        # the training wing's rooms: measurement and checkpoints under training, beside each other; the model under
        # both; the config under the model; none of them under the planning packages
        ("megatron_epp/measure/profiling.py", "import megatron_epp.training.step", "Layers"),
        ("megatron_epp/checkpoint/hf_llama.py", "import megatron_epp.measure.profiling", "Layers"),
        ("megatron_epp/measure/layer_bench.py", "import megatron_epp.checkpoint.checkpointing", "Layers"),
        ("megatron_epp/model/runtime.py", "import megatron_epp.measure.profiling", "Layers"),
        ("megatron_epp/config/fields.py", "import megatron_epp.model.gpt", "Layers"),
        ("megatron_epp/cost/model.py", "import megatron_epp.config.fields", "never import training"),
        ("megatron_epp/planner/cli.py", "import benchmarks.common", "The library never imports the benchmarks nor the tests"),
        ("megatron_epp/training/replay.py", "import tests.paths", "The library never imports the benchmarks nor the tests"),
        ("benchmarks/common.py", "import tests.paths", "The benchmarks never import the tests"),
    ],
)
def test_planted_violation_breaks_a_contract(tmp_path, module, line, contract):
    for name in ("megatron_epp", "patches", "benchmarks", "tests"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # planted\n")
    out = lint(tmp_path)
    assert out.returncode != 0
    assert "Broken contracts" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]  # the linter ran and found a break
    broken = out.stdout.split("Broken contracts")[-1]  # only the broken contracts are reported below this
    assert contract in broken, out.stdout[-2000:]
