"""gloo's ``all_to_all_single`` between the ranks of this host, alone (a barrier before each call, nothing else
running): the median, 10th and 90th percentile of 50 calls per size (bytes each rank holds); last line JSON.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 docs/measurements/2026-11-27-cpu-cp/scripts/gloo_all_to_all.py
"""

import json
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
rows = []
for nbytes in [0, 4096, 65536, 196608, 1048576, 4194304]:
    n = max(nbytes // 4, 2) // 2 * 2
    x, y = torch.randn(n), torch.empty(n)
    for _ in range(5):
        dist.all_to_all_single(y, x)
    ts = []
    for _ in range(50):
        dist.barrier()
        t = time.perf_counter()
        dist.all_to_all_single(y, x)
        ts.append(time.perf_counter() - t)
    ts.sort()
    rows.append({"bytes": nbytes, "median_us": ts[25] * 1e6, "p10_us": ts[5] * 1e6, "p90_us": ts[45] * 1e6})
    if rank == 0:
        print(f"{nbytes:>8} B per rank: median {ts[25] * 1e6:.0f} us, p10 {ts[5] * 1e6:.0f}, p90 {ts[45] * 1e6:.0f}", flush=True)
if rank == 0:
    print(json.dumps({"world": dist.get_world_size(), "rows": rows}))
dist.destroy_process_group()
