#!/usr/bin/env python3
"""Pretrain a GPT with Megatron-Core pipeline parallelism; run it under torchrun.

    torchrun --nproc-per-node 2 pretrain_gpt.py --pipeline-model-parallel-size 2 --mock-data ...
    torchrun --nproc-per-node 2 pretrain_gpt.py --pipeline-model-parallel-size 2 --elastic-pp ...
"""

import sys

from megatron_epp.config.errors import ArgumentError
from megatron_epp.config.parser import parse_config


def run(argv: list[str] | None = None) -> int:
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


if __name__ == "__main__":
    from megatron_epp.training.host_allocator import reexec_with_jemalloc

    try:
        reexec_with_jemalloc()  # the host allocator is chosen at process start: EPP_HOST_ALLOCATOR
    except ValueError as error:
        print(f"pretrain_gpt.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run())
