#!/usr/bin/env python3
"""Pretrain a GPT with Megatron-Core pipeline parallelism; run it under torchrun.

    torchrun --nproc-per-node 2 pretrain_gpt.py --pipeline-model-parallel-size 2 --mock-data ...
"""

import sys

from megatron_epp.training.main import main

if __name__ == "__main__":
    sys.exit(main())
