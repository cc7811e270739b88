"""Where the tests find the repository, their data, and the shared data beside the clone (one place for each)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEST_DATA = REPO / "tests" / "data"
SHARED = REPO.parent / "shared"  # ../shared beside the clone (CI has it there too)
