"""The simulator's walk before and after the op lists carried sends and receives: BASE's ``simulator/step.py``
(``git show BASE:...``, default main; it walks the compute ops only) loaded beside this checkout's in one process,
on the same 30 random plans (2, 4 and 8 stages, 1-3 pipelines): (1) every event and the step time equal;
(2) paired timing of ``step_ms``, alternating which runs first, 21 repetitions. Last line JSON.

    PYTHONPATH=. python3 docs/measurements/2026-11-27-cpu-oplists/simulator_walk_ab.py [BASE]
"""
import importlib.util, json, statistics, subprocess, sys, tempfile, time
import numpy as np
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.profile_lookup import load_profile
from megatron_epp.simulator import step as new
from tests.workers.random_plans import random_plan

base = sys.argv[1] if len(sys.argv) > 1 else "main"
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(subprocess.check_output(["git", "show", f"{base}:megatron_epp/simulator/step.py"], text=True))
spec = importlib.util.spec_from_file_location("step_base", f.name)
old = importlib.util.module_from_spec(spec)
sys.modules["step_base"] = old
spec.loader.exec_module(old)
prof = load_profile("test-model")
rng = np.random.default_rng(5)
plans = []
for stages in (2, 4, 8):
    cm = CostModel(prof, stages)
    for _ in range(10):
        plans.append((random_plan(rng, [int(x) for x in rng.integers(24, 64, size=12)], stages, 1), cm))
for plan, cm in plans:
    a, b = old.simulate(plan, cm), new.simulate(plan, cm)
    assert a.step_ms == b.step_ms and a.recompute_ms == b.recompute_ms and (a.peak_memory == b.peak_memory).all()
    assert [tuple(vars(e).values()) for e in a.events] == [tuple(vars(e).values()) for e in b.events]


def run(mod) -> float:
    t = time.perf_counter()
    for plan, cm in plans:
        mod.step_ms(plan, cm)
    return time.perf_counter() - t


ratios, olds, news = [], [], []
for rep in range(21):
    if rep % 2 == 0:
        a = run(old); b = run(new)
    else:
        b = run(new); a = run(old)
    olds.append(a); news.append(b); ratios.append(b / a)
print(json.dumps({"base": base, "plans": len(plans), "events_equal": True, "reps": 21,
                  "base_s_median": statistics.median(olds), "this_s_median": statistics.median(news),
                  "ratio_this_over_base_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}))
