"""Two ranks stop on a :class:`TrainingFault` as ``pretrain_gpt.py`` does (``report_fault``, then exit 1), the logging
rank (the last) slow to get there by ``EPP_TEST_LOGGING_DELAY_S`` seconds: the one error line must be on stderr
whichever rank's exit the launcher sees first (it stops the other ranks at the first exit that is not 0)."""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

from megatron_epp.training.faults import TrainingFault, report_fault


def main() -> int:
    dist.init_process_group("gloo")
    logging_rank = dist.get_rank() == dist.get_world_size() - 1
    if logging_rank:
        time.sleep(float(os.environ["EPP_TEST_LOGGING_DELAY_S"]))
    report_fault(TrainingFault("a planted fault"), logging_rank)
    return 1


if __name__ == "__main__":
    sys.exit(main())
