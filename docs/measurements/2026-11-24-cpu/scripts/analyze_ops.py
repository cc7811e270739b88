"""Measured ops of ``timed_pretrain.py`` against the simulator's events of the same plans (wiki benchmark flags).

    python analyze_ops.py OPS_DIR
"""
import json, os, sys
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path.insert(0, REPO); sys.path.insert(0, os.path.join(REPO, "scripts"))
OPS_DIR = sys.argv[1]
import numpy as np
from megatron_epp.plan import Plan
from megatron_epp.simulator.step import simulate
import bench_elastic as be
args = be.parse(["--datasets", "wiki"]); argv = be.run_argv(args, "wiki")
_, build = be.planned_batches(argv, 1)
cm = build.cost_model
r0 = [json.loads(l) for l in open(os.path.join(OPS_DIR, "ops_rank0.jsonl"))]
r1 = [json.loads(l) for l in open(os.path.join(OPS_DIR, "ops_rank1.jsonl"))]
for step, (a, b) in enumerate(zip(r0, r1), 1):
    plan = Plan.from_json(a["plan_json"])
    sim = simulate(plan, cm)
    out = [f"step {step} {a['plan'][:40]} sim {sim.step_ms:.0f} busy {np.round(sim.busy_ms)}"]
    for rank, r in ((0, a), (1, b)):
        span = (r["t1"] - r["t0"]) * 1e3
        comp = {k: sum((e[3] - e[2]) * 1e3 for e in r["ops"] if e[0] == k) for k in ("F", "B", "CF", "CB", "R")}
        gcs = [(e[0], round((e[3] - e[2]) * 1e3, 1)) for e in r["ops"] if e[0].startswith("GC")]
        out.append(f"  rank {rank} gc: {sum(g[1] for g in gcs):.0f} ms in {len(gcs)} collections, gen2: {[g[1] for g in gcs if g[0] == 'GC2']}")
        out.append(f"  rank {rank}: span {span:.0f} F {comp['F']:.0f} B {comp['B']:.0f} (compute {comp['F'] + comp['B']:.0f}) comm/wait {comp['CF'] + comp['CB'] + comp['R']:.0f}")
    # per-chunk compare for rank 0: forward times vs simulated events
    ev = sorted([e for e in sim.events if e.stage == 0 and e.op == "F"], key=lambda e: e.start)
    meas = [e for e in a["ops"] if e[0] == "F"]
    if len(ev) == len(meas):
        pairs = [((m[3] - m[2]) * 1e3, e.end - e.start) for m, e in zip(meas, ev)]
        out.append("  rank0 F meas/sim per chunk: " + " ".join(f"{m:.0f}/{s:.0f}" for m, s in pairs[:24]))
    evb = sorted([e for e in sim.events if e.stage == 0 and e.op == "B"], key=lambda e: e.start)
    measb = [e for e in a["ops"] if e[0] == "B"]
    if len(evb) == len(measb):
        out.append("  rank0 B meas/sim per chunk: " + " ".join(f"{(m[3] - m[2]) * 1e3:.0f}/{e.end - e.start:.0f}" for m, e in zip(measb, evb)))
        out.append("  rank0 B minor faults: " + " ".join(str(m[1]) for m in measb) + " | F: " + " ".join(str(m[1]) for m in meas))
    print("\n".join(out))
