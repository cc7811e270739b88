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

from megatron_epp.training.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
