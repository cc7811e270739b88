"""``python -m benchmarks.paper_grid --quick``: its last line is the JSON object of the grid's cells."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from tests.paths import REPO

ROOT = REPO


def test_quick_grid_last_line_is_the_cells_json(tmp_path):
    """And its ``--cells`` file gives the same table again (``--report-only``) and ``benchmarks.paper_grid_cp``'s rows
    (a whole re-run grid compared row by row with an earlier one: here with itself)."""
    readme, cells = tmp_path / "README.md", tmp_path / "cells.jsonl"  # not there yet: the script writes the block into a new file
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(script: str, *args: str) -> str:
        return subprocess.run([sys.executable, "-m", f"benchmarks.{script.removesuffix('.py')}", *args], capture_output=True, text=True, env=env, cwd=ROOT,
                              check=True, timeout=600).stdout

    out = run("paper_grid.py", "--quick", "--readme", str(readme), "--cells", str(cells))
    last = json.loads(out.strip().splitlines()[-1])
    assert set(last) == {"cells", "headline"} and len(last["cells"]) == 1
    cell = last["cells"][0]
    assert {"data", "model", "cap", "epp_ms", "flexsp", "seq1f1b", "megatron", "bound"} <= set(cell)
    assert cell["data"] == "github" and cell["model"] == "llama-7b" and cell["cap"] == 49152 and cell["epp_ms"] > 0
    for name in ("flexsp", "seq1f1b", "megatron"):
        assert cell[name] is None or cell[name] > 0
    assert 0 < cell["bound"] <= 1  # the compute-only bound is below EPP's step
    assert cell["seq1f1b"] >= 1 and cell["megatron"] >= 1  # EPP weighs their plans on a superset of their layouts
    text = readme.read_text()
    assert text.startswith("<!-- paper-grid:begin -->") and "| github | llama-7b | 48K | a800-ib-node |" in text
    again = run("paper_grid.py", "--quick", "--readme", str(tmp_path / "again.md"), "--cells", str(cells), "--report-only")
    assert again.splitlines()[:3] == out.splitlines()[:3] and json.loads(again.strip().splitlines()[-1]) == last
    rows = run("paper_grid_cp.py", "--old", str(cells), "--cells", str(cells), "--all-rows", "--report-only")
    report = json.loads(rows.strip().splitlines()[-1])
    assert report["done"] == report["of"] == 1 and report["rows"][0]["new_gain"] == 0.0
    assert report["rows"][0]["new_layout"] == json.loads(cells.read_text())["systems"]["epp"]["layout"]
