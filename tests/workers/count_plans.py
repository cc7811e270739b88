"""``pretrain_gpt.py`` with a count of the plans its planner made (per process, printed at exit, after the
planner's thread has finished): ``count_plans.py FLAGS``."""

from __future__ import annotations

import atexit
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_epp.planner.online import OnlinePlanner  # noqa: E402
import pretrain_gpt  # noqa: E402

plans = []
real = OnlinePlanner.__call__


def counting(self, lengths, cost_model=None):
    plans.append(len(lengths))
    return real(self, lengths, cost_model)


OnlinePlanner.__call__ = counting
atexit.register(lambda: print(f"rank {os.environ.get('RANK')}: plans made: {len(plans)}", flush=True))

if __name__ == "__main__":
    sys.exit(pretrain_gpt.run(sys.argv[1:]))
