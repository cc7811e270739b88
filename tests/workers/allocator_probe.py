"""pretrain_gpt.py as run from the command line (its __main__: the host-allocator re-execution), writing the
process's memory maps at exit to $EPP_TEST_MAPS (tests/integration/test_host_allocator.py)."""

import atexit
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
atexit.register(lambda: Path(os.environ["EPP_TEST_MAPS"]).write_text(Path("/proc/self/maps").read_text()))
sys.argv[0] = str(REPO / "pretrain_gpt.py")
runpy.run_path(str(REPO / "pretrain_gpt.py"), run_name="__main__")
