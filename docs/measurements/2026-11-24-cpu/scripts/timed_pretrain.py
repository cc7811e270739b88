"""pretrain_gpt.py with every op of the elastic schedule timed per rank: a diagnostic (2026-11-24, committed with cae312b), not part of the product.

Wraps the executor's forward, backward, p2p and receive calls (``megatron_epp.executor.schedule``) with
``perf_counter`` and the process's minor page faults, records Python's garbage collections, and appends one JSON
line per step to ``$OPS_DIR/ops_rank{RANK}.jsonl`` (the step's span, plan, and every op). Run it as pretrain_gpt.py:

    OPS_DIR=/tmp/ops OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 timed_pretrain.py <flags>
    python analyze_ops.py /tmp/ops <the same flags>     # measured per op vs the simulator's events
"""
import json, os, sys, time, runpy, resource
flt = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path.insert(0, REPO)
OPS_DIR = os.environ.get("OPS_DIR", ".")
import torch
from megatron_epp.executor import schedule as S
records = []
import gc
_gc_t = {}
def _gc_cb(phase, info):
    if phase == "start":
        _gc_t["t"] = time.perf_counter()
    else:
        records.append(("GC%d" % info["generation"], info.get("collected", 0), _gc_t.get("t", time.perf_counter()), time.perf_counter()))
gc.callbacks.append(_gc_cb)
orig_fwd, orig_sr, orig_recv = S._StageRunner._forward, S._StageRunner._send_then_receive, S._StageRunner._receive
orig_bwd = S.backward_step
def fwd(self, input_tensor, pos):
    f0 = flt(); t = time.perf_counter(); out = orig_fwd(self, input_tensor, pos); records.append(("F", flt() - f0, t, time.perf_counter())); return out
def bwd(*a, **k):
    f0 = flt(); t = time.perf_counter(); out = orig_bwd(*a, **k); records.append(("B", flt() - f0, t, time.perf_counter())); return out
def sr(self, kind, tensor, layouts, nxt):
    t = time.perf_counter(); out = orig_sr(self, kind, tensor, layouts, nxt); records.append(("C" + kind, -1, t, time.perf_counter())); return out
def recv(self, layouts, op):
    t = time.perf_counter(); out = orig_recv(self, layouts, op); records.append(("R", -1, t, time.perf_counter())); return out
S._StageRunner._forward, S._StageRunner._send_then_receive, S._StageRunner._receive = fwd, sr, recv
S.backward_step = bwd
orig_feb = S.forward_backward_elastic
def feb(*a, **k):
    records.clear(); t0 = time.perf_counter(); out = orig_feb(*a, **k); t1 = time.perf_counter()
    plan = k["plan"]
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(OPS_DIR, f"ops_rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"t0": t0, "t1": t1, "plan": plan.summary(), "plan_json": plan.to_json(), "ops": records}) + "\n")
    return out
S.forward_backward_elastic = feb
import megatron_epp.training.elastic as E
if hasattr(E, "forward_backward_elastic"):
    E.forward_backward_elastic = feb
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
runpy.run_path(os.path.join(REPO, "pretrain_gpt.py"), run_name="__main__")
