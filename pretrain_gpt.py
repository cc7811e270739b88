#!/usr/bin/env python3
"""Pretrain a GPT with Megatron-Core pipeline parallelism; run it under torchrun.

    torchrun --nproc-per-node 2 pretrain_gpt.py --pipeline-model-parallel-size 2 --mock-data ...
    torchrun --nproc-per-node 2 pretrain_gpt.py --pipeline-model-parallel-size 2 --elastic-pp ...
"""

import sys
import warnings

# megatron-core warns at import that the optional GPU extras are absent: expected on CPU machines, and
# they would stand before the one-line error of a bad flag.
warnings.filterwarnings("ignore", message="(Transformer Engine and )?Apex (is|are) not installed")

from megatron_epp.training.arguments import ArgumentError, parse_config  # noqa: E402


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
