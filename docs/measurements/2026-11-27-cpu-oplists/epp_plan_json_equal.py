"""``epp-plan --json`` of two checkouts on the same lengths and flags (4 configurations: 2, 4 and 8 stages, dp 2,
a binding memory budget; the test-model profile), ``solve_ms`` aside (a timing). Last line JSON.

    python3 docs/measurements/2026-11-27-cpu-oplists/epp_plan_json_equal.py BASE_CHECKOUT THIS_CHECKOUT
"""
import json, os, subprocess, sys, tempfile

LENGTHS = [3000, 1200, 800, 500, 300, 200, 150, 90, 60, 40, 20, 10] * 2 + [4000, 2500]
CONFIGS = [["--stages", "4", "--max-seq-len", "4096"], ["--stages", "2", "--max-seq-len", "4096", "--dp", "2"],
           ["--stages", "4", "--max-seq-len", "4096", "--epp-memory-budget", "0.3"], ["--stages", "8", "--max-seq-len", "4096"]]
RUN = """
import json, sys
from megatron_epp.planner.cli import main
main(sys.argv[1:])
"""


def summaries(checkout: str, lengths: str) -> list[dict]:
    out = []
    for flags in CONFIGS:
        proc = subprocess.run([sys.executable, "-c", RUN, lengths, "--epp-profile", "test-model", "--json", *flags], cwd=checkout,
                              env={**os.environ, "PYTHONPATH": checkout, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, check=True)
        d = json.loads(proc.stdout.splitlines()[-1])
        d.pop("solve_ms")
        for b in d.get("baselines", {}).values():
            b.pop("solve_ms", None)
        out.append(d)
    return out


with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
    f.write("\n".join(map(str, LENGTHS)) + "\n")
base, this = summaries(sys.argv[1], f.name), summaries(sys.argv[2], f.name)
print(json.dumps({"configurations": len(CONFIGS), "equal": base == this,
                  "predicted_step_ms": [[b["predicted_step_ms"], t["predicted_step_ms"]] for b, t in zip(base, this)]}))
