"""``scripts/paper_grid.py --quick``: its last line is the JSON object of the grid's cells."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from tests.paths import REPO

ROOT = REPO


def test_quick_grid_last_line_is_the_cells_json(tmp_path):
    readme = tmp_path / "README.md"  # not there yet: the script writes the block into a new file
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "paper_grid.py"), "--quick", "--readme", str(readme)],
                         capture_output=True, text=True, env=env, check=True, timeout=600).stdout
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
