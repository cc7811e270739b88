"""``pretrain_gpt.py`` with two probes, run in its place under torchrun (the same flags):

* every ``torch.distributed.all_to_all_single`` call timed (context parallelism's all-to-alls, forward and backward):
  on exit each rank prints ``[probe rank R] a2a calls N total T ms, B MiB, per call U us``;
* with ``PROBE_PROF=FILE``: torch.profiler over the 6th to the 9th training step's ``forward_backward_elastic`` on
  rank 0, its ops by self CPU time written to FILE.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 docs/measurements/2026-11-27-cpu-cp/scripts/timed_all_to_all.py \
        --elastic-pp ... --context-parallel-size 2
"""

import atexit
import os
import runpy
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))
acc = {"n": 0, "t": 0.0, "bytes": 0}
_all_to_all_single = dist.all_to_all_single


def timed(out, inp, *args, **kwargs):
    t = time.perf_counter()
    result = _all_to_all_single(out, inp, *args, **kwargs)
    acc["t"] += time.perf_counter() - t
    acc["n"] += 1
    acc["bytes"] += inp.numel() * inp.element_size()
    return result


dist.all_to_all_single = c10d.all_to_all_single = timed
atexit.register(lambda: print(f"[probe rank {os.environ.get('RANK')}] a2a calls {acc['n']} total {acc['t'] * 1e3:.0f} ms, "
                              f"{acc['bytes'] / 2**20:.1f} MiB, per call {acc['t'] / max(acc['n'], 1) * 1e6:.0f} us", flush=True))

if os.environ.get("PROBE_PROF"):
    from megatron_epp.training import elastic

    _run = elastic.ElasticTrainStep._run
    state = {"n": 0, "prof": None}

    def profiled_run(self, *args, **kwargs):
        state["n"] += 1
        if state["n"] == 6:
            state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            state["prof"].__enter__()
        result = _run(self, *args, **kwargs)
        if state["n"] == 9 and state["prof"] is not None:
            state["prof"].__exit__(None, None, None)
            if os.environ.get("RANK", "0") == "0":
                Path(os.environ["PROBE_PROF"]).write_text(
                    state["prof"].key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        return result

    elastic.ElasticTrainStep._run = profiled_run

sys.argv = [str(REPO / "pretrain_gpt.py"), *sys.argv[1:]]
runpy.run_path(str(REPO / "pretrain_gpt.py"), run_name="__main__")
