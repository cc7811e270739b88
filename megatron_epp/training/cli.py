"""``pretrain_gpt.py``'s command line as a function: the flags parsed and validated, then the run
(``python -m megatron_epp.training.main FLAGS`` is the same)."""

from __future__ import annotations

import sys
from typing import Sequence

from megatron_epp.training.arguments import ArgumentError, parse_config


def run(argv: Sequence[str] | None = None) -> int:
    """``pretrain_gpt.py FLAGS`` (``argv``, default the command line's): exit status 2 and one line for bad flags."""
    try:
        cfg = parse_config(sys.argv[1:] if argv is None else argv)
    except ArgumentError as error:
        print(error, file=sys.stderr)
        return 2
    # The trainer (megatron-core, the executor) is imported once the flags have parsed: a bad flag is answered
    # without megatron-core's import, seconds per process.
    from megatron_epp.training.main import main

    return main(cfg)
