"""First-contact helper (not part of the repo): scripts/check_cuda_attention.py's layouts and harness,
but for the backends that run WITHOUT flash-attn (sdpa-causal, sdpa-masked), since the repo's script
exits 2 when flash-attn does not import. Same inputs, same fp32 reference (sdpa-masked in float32),
same timing (median CUDA-event ms of the layout's forward+backward after one warm-up).

    python3 attn_check_nofl.py [--slice-tokens 8192 --heads 32 --kv-heads 8 --head-dim 128] [--cpu-dry-run]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(os.environ.get("EPP_REPO", Path(__file__).resolve().parent / "repo"))
sys.path.insert(0, str(REPO))
spec = importlib.util.spec_from_file_location("cca", REPO / "scripts" / "check_cuda_attention.py")
cca = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cca)  # its module-level code only inserts REPO into sys.path and imports

import torch  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--slice-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", default="sdpa-causal,sdpa-masked")
    p.add_argument("--json", default=None)
    p.add_argument("--cpu-dry-run", action="store_true")
    a = p.parse_args()
    if a.cpu_dry_run:
        device, dtype = "cpu", torch.float32
        a.heads, a.kv_heads, a.head_dim, a.slice_tokens, a.repeats = 4, 2, 8, 64, 2
    else:
        device, dtype = "cuda", torch.bfloat16
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    backends = a.backends.split(",")
    print(f"heads {a.heads}, kv heads {a.kv_heads}, head dim {a.head_dim}, slice {a.slice_tokens} tokens, {dtype}; backends {backends}")
    attention = cca.make_attention(a.heads, a.kv_heads, a.head_dim)
    results = {}
    for name, plan in cca.layouts(a.slice_tokens).items():
        tensors = cca.random_tensors(plan, a.heads, a.kv_heads, a.head_dim, torch.float32, device, seed=0)
        cca.force("sdpa-masked")
        reference = cca.run_plan(attention, plan, tensors, device)
        low = [[type(t)(*(x.to(dtype) for x in (t.q, t.k, t.v, t.grad_out))) for t in row] for row in tensors]
        chunks = ", ".join(
            f"{c.kind}({'+'.join(str(s.length) for s in c.segments)}, C={c.segments[0].start if c.kind == 'split' else max(s.start for s in c.segments)})"
            for c in plan.chunks()
        )
        print(f"\n{name}: {chunks}")
        print(f"  {'backend':<13} {'fwd+bwd ms':>10} {'peak GB':>8}   worst rel. error vs fp32 sdpa-masked: out dq dk dv")
        results[name] = {"chunks": chunks}
        for backend in backends:
            cca.force(backend)
            try:
                err = cca.worst_errors(cca.run_plan(attention, plan, low, device), reference)
                ms, peak = cca.timed(lambda: cca.run_plan(attention, plan, low, device), device, a.repeats)
            except Exception as error:  # record and go on
                print(f"  {backend:<13} FAILED: {type(error).__name__}: {str(error)[:300]}")
                results[name][backend] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                continue
            print(f"  {backend:<13} {ms:10.2f} {peak:8.2f}   " + " ".join(f"{err[k]:.1e}" for k in ("out", "dq", "dk", "dv")))
            results[name][backend] = {"ms": ms, "peak_gb": peak, "errors": err}
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
