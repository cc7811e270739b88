"""First-contact helper: compare equivalence-worker dumps with the test suite's own metric
(tests/integration/test_elastic_equivalence.py: worst of |loss - ref| / |ref| and, per parameter,
||g - g_ref|| / ||g_ref||), case by case; prints and writes JSON.

    python3 equiv_compare.py OUT.json NAME=REF_DIR:TEST_DIR:CASES ...
"""

import json
import os
import sys
from pathlib import Path

REPO = Path(os.environ.get("EPP_REPO", Path(__file__).resolve().parent / "repo"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tests.integration.test_elastic_equivalence import load, tensor_parallel_shard  # noqa: E402


def detail(reference: Path, test: Path, case: int) -> dict:
    (ref_loss, ref), (loss, grads) = load(reference, case), load(test, case)
    ref_loss, loss = float(ref_loss), float(loss)
    out = {"loss": loss, "ref_loss": ref_loss, "loss_rel": abs(loss - ref_loss) / abs(ref_loss)}
    if grads.keys() != ref.keys():
        out["error"] = f"parameter names differ: {sorted(set(grads) ^ set(ref))[:5]}"
        return out
    worst, name = 0.0, None
    for n, full in ref.items():
        g = tensor_parallel_shard(full.float().cpu(), grads[n].float().cpu())
        rel = float((grads[n].float().cpu() - g).norm() / g.norm().clamp_min(1e-12))
        if rel > worst:
            worst, name = rel, n
    out.update(grad_rel=worst, worst_param=name, worst=max(worst, out["loss_rel"]))
    return out


def main() -> int:
    result = {}
    for item in sys.argv[2:]:
        label, spec = item.split("=", 1)
        ref, test, cases = spec.split(":")
        rows = []
        for c in range(int(cases)):
            try:
                rows.append(detail(Path(ref), Path(test), c))
            except Exception as error:
                rows.append({"case": c, "error": f"{type(error).__name__}: {str(error)[:200]}"})
        worst = max((r.get("worst", float("nan")) for r in rows if "worst" in r), default=float("nan"))
        result[label] = {"worst": worst, "cases": rows}
        print(f"{label:<34} cases {len(rows)}  worst rel. error (loss or any grad) {worst:.3e}  "
              + " ".join(f"{r['worst']:.1e}" if "worst" in r else "ERR" for r in rows), flush=True)
    Path(sys.argv[1]).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
