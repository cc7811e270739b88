#!/usr/bin/env python3
"""Pretrain a GPT with Megatron-Core pipeline parallelism; run it under torchrun.

    torchrun --nproc-per-node 2 pretrain_gpt.py --pipeline-model-parallel-size 2 --mock-data ...
    torchrun --nproc-per-node 2 pretrain_gpt.py --pipeline-model-parallel-size 2 --elastic-pp ...
"""

import sys

from megatron_epp.training.cli import run  # noqa: F401  (tests call pretrain_gpt.run)


if __name__ == "__main__":
    from megatron_epp.training.host_allocator import reexec_with_jemalloc

    try:
        reexec_with_jemalloc()  # the host allocator is chosen at process start: EPP_HOST_ALLOCATOR
    except ValueError as error:
        print(f"pretrain_gpt.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run())
