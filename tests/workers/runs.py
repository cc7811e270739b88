"""Several runs in one launch of a test worker: ``WORKER RUN_ARGS... :: RUN_ARGS... :: ...`` (one process start, and
megatron-core's import, for all of them)."""

from __future__ import annotations

RUN_SEPARATOR = "::"


def split_runs(argv: list[str]) -> list[list[str]]:
    """``A... :: B... :: C...`` -> ``[[A...], [B...], [C...]]``: a launch's runs."""
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == RUN_SEPARATOR:
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs
