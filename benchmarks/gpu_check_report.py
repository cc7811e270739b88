#!/usr/bin/env python3
"""What ``scripts/gpu_check.sh`` measured, as one JSON line (its last line), from the files it wrote in its output folder.

    python -m benchmarks.gpu_check_report OUT_DIR                            # the whole report (JSON, last line)
    python -m benchmarks.gpu_check_report --train METRICS [--default-path]   # the train step's verdict (one line, exit 1: FAIL)

The report holds, per step, its status, seconds and limit (``steps.tsv``), and what the README's GPU claims rest on:

* ``facts``: the GPU, torch and CUDA versions, what imports;
* ``attention``: per layout and kernel the forward+backward ms and worst relative error against fp32, the verdict, and
  the bytes torch-varlen saves per layer with GQA and whether its K/V heads were expanded;
* ``equivalence``: passed / failed / skipped;
* ``train``: the start-up lines (the profile and where it came from, the memory budget, the CUDA allocator's
  configuration, the attention kernel), any out-of-memory recovery line, and per step the loss, ms, tokens/s, TFLOP/s,
  the plan (chunks by kind, recomputed layers), the predicted and measured step ms, and memory against the budget:
  the planner's model states plus the allocator's reserved peak above the step's start (what runs out) and its
  allocated peak, the predicted peak, the memory factor and the out-of-memory retries;
* ``baseline`` (``--quick``): the same training run with the kernels before flash-attn-4 and the fused pointwise ops
  (its ``baseline.log`` and ``metrics_baseline.jsonl``), as ``train``; ``kernels_ab``: the two paired by iteration (the
  same batches): each step's ms, TFLOP/s and MFU (the GPU's dense bf16 peak: :data:`PEAK_BF16_TFLOPS`) both ways and
  the baseline's ms over the new kernels' (> 1: the new kernels faster), with medians over the steps after the first;
* ``traces`` (``--quick``): one profiled iteration of each of the two runs by kernel class (benchmarks/trace_kernels.py:
  attention, GEMM, norm, Triton, elementwise, ... ms and share, the device's busy share of the step);
* ``offload`` (the opt-in ``offload`` step): the train step's run with ``--epp-offload checkpoints`` as ``train``, and
  ``offload_ab``: it paired with the train step's run by iteration as ``kernels_ab`` pairs (``speedup`` < 1: what the
  offload costs there);
* ``fused``: benchmarks/fused_kernels.py's last JSON line (each pointwise candidate's time and error per op);
* ``longest`` (the opt-in ``longest`` step): benchmarks/longest_trainable.py's last JSON line (per offload mode the
  longest document trained and every probe; both modes' step time at the longest length both train);
* ``bench``: bench_gpu.py's last JSON line.

Nothing is computed that the logs do not hold; a file that is missing gives null (its step did not run or died).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path


from megatron_epp.cost.clusters import H100_SXM
from megatron_epp.base.units import GIB
from megatron_epp.training.metrics import StepMetrics, read_metrics
from benchmarks.common import Parser


def _text(path: Path) -> str | None:
    return path.read_text(errors="replace") if path.is_file() else None


def steps_table(out: Path) -> dict:
    text = _text(out / "steps.tsv") or ""
    rows = [line.split("\t") for line in text.splitlines() if line.strip()]
    return {name: {"status": status, "seconds": int(took), "limit_s": int(limit)} for name, status, took, limit in rows}


def facts(out: Path) -> dict | None:
    text = _text(out / "facts.log")
    if text is None:
        return None
    gpu = re.search(r"^gpu (.+)$", text, re.M)
    torch_line = re.search(r"^torch (\S+) cuda (\S+) python (\S+)", text, re.M)
    imports = dict(re.findall(r"^import (\S+): (ok|no)", text, re.M))
    return {"gpu": gpu.group(1) if gpu else None, "torch": torch_line.group(1) if torch_line else None,
            "cuda": torch_line.group(2) if torch_line else None, "imports": imports}


def attention(out: Path) -> dict | None:
    text = _text(out / "attention.log")
    if text is None:
        return None
    layouts, current = {}, None
    for line in text.splitlines():
        head = re.match(r"^(\S[^:]*): ", line)
        if head and not line.startswith(("PASS", "FAIL", "saved bytes", "check_cuda_attention", "heads ")):
            current = layouts.setdefault(head.group(1), {})
            continue
        row = re.match(r"^  (\S+)\s+([0-9.]+)\s+(\d+)\s+(\S+)\s+(?:([0-9.]+)\s+)?([0-9.]+|-)\s+(\S+) (\S+) (\S+) (\S+)$", line)
        if row and current is not None:  # TFLOP/s from 2026-11-29 on (not in older logs)
            errors = [float(x) for x in row.group(7, 8, 9, 10)]
            current[row.group(1)] = {"ms": float(row.group(2)), "peak_gb": _number(row.group(4)), "tflops": _number(row.group(5)),
                                     "worst_rel_err": max(errors)}
    saved = re.search(r"^saved bytes per layer: (\S+) (\d+) \(K/V heads not expanded: (yes|no)\)(.*)$", text, re.M)
    verdict = re.search(r"^(PASS|FAIL)\b.*$", text, re.M)
    return {"layouts": {name: rows for name, rows in layouts.items() if rows}, "verdict": verdict.group(0) if verdict else None,
            "saved_bytes_per_layer": int(saved.group(2)) if saved else None,
            "kv_heads_expanded": None if not saved else saved.group(3) == "no", "saved_note": saved.group(4).strip() if saved else None}


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isnan(value) else value


def equivalence(out: Path) -> dict | None:
    text = _text(out / "equivalence.log")
    if text is None:
        return None
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", text)}
    return {k: counts.get(k, 0) for k in ("passed", "failed", "skipped", "error")}


def step_entry(m: StepMetrics) -> dict:
    """One training step's figures (memory in GiB, per stage)."""
    e = m.elastic
    entry = {"iteration": m.iteration, "loss": m.loss, "iter_ms": m.iter_ms, "tokens": m.tokens, "tokens_per_s": m.tokens_per_s,
             "tflops": m.tflops_per_gpu, "plan": e.plan if e else None}
    if e is None:
        return entry
    entry.update(chunks=e.num_chunks, recomputed_layers=e.recomputed_layers, predicted_ms=e.predicted_step_ms, measured_ms=e.measured_ms,
                 memory_factor=e.memory_factor, oom_retries=e.oom_retries)
    if e.measured_activation_bytes is not None and e.model_state_bytes is not None:
        states = e.model_state_bytes
        allocated = e.measured_allocated_bytes or e.measured_activation_bytes
        entry["memory_gb"] = {
            "budget": None if e.memory_budget_bytes is None else e.memory_budget_bytes / GIB,
            "model_states": [s / GIB for s in states],
            "peak_reserved": [(s + a) / GIB for s, a in zip(states, e.measured_activation_bytes)],
            "peak_allocated": [(s + a) / GIB for s, a in zip(states, allocated)],
            "predicted_peak": [(s + a) / GIB for s, a in zip(states, e.predicted_activation_bytes)],
        }
    return entry


def train_figures(metrics: Path, log: Path | None = None) -> dict | None:
    if not metrics.is_file():
        return None
    steps = [m for m in read_metrics(metrics) if m.kind == "train"]
    text = _text(log) if log is not None else None
    lines = {}
    if text:
        for key, pattern in (("planner", r"^> planner: .*$"), ("memory_budget", r"^> memory budget: .*$"),
                             ("cuda_allocator", r"^> CUDA allocator: .*$"), ("attention", r"^> elastic attention: .*$")):
            found = re.search(pattern, text, re.M)
            lines[key] = found.group(0)[2:] if found else None
        lines["out_of_memory"] = re.findall(r"^ iteration \d+: out of memory on .*$", text, re.M)
    entries = [step_entry(m) for m in steps]
    over = [e["iteration"] for e in entries
            if "memory_gb" in e and e["memory_gb"]["budget"] is not None and max(e["memory_gb"]["peak_reserved"]) > e["memory_gb"]["budget"]]
    later = steps[1:] or steps
    return {"lines": lines, "steps": entries, "iterations": len(steps),
            "steps_over_budget": over, "oom_retries": sum(m.elastic.oom_retries for m in steps if m.elastic),
            "median_tflops": _median([m.tflops_per_gpu for m in later if m.tflops_per_gpu is not None]),
            "median_tokens_per_s": _median([m.tokens_per_s for m in later]),
            "recomputed_layers": sum(m.elastic.recomputed_layers for m in steps if m.elastic),
            "largest_predicted_peak_share": binding_share(steps)}


BINDING_SHARE = 0.9  # a plan whose predicted peak reaches this share of the budget (or that recomputes) was shaped by it


def binding_share(steps: list[StepMetrics]) -> float | None:
    """The largest predicted peak (model states + activations, any stage) over the budget, over the steps (None: not
    recorded)."""
    shares = [max(s + a for s, a in zip(m.elastic.model_state_bytes, m.elastic.predicted_activation_bytes)) / m.elastic.memory_budget_bytes
              for m in steps if m.elastic and m.elastic.model_state_bytes and m.elastic.memory_budget_bytes]
    return max(shares) if shares else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _clean(value):
    """``value`` with NaN and infinities as None (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def train_verdict(metrics: Path, default_path: bool) -> tuple[bool, str]:
    """The train step's line: the loss finite over at least 3 steps; on the full check's Seq1F1B run also falling, with
    split and hybrid chunks. Whether the budget bound (a predicted peak within 10 % of it, or recompute) is said, not
    judged: it depends on the GPU's memory."""
    steps = [m for m in read_metrics(metrics) if m.kind == "train"]
    if len(steps) < 3:
        return False, f"train: FAIL: {len(steps)} iterations recorded"
    losses = [m.loss for m in steps]
    split = sum(m.elastic.num_chunks["split"] for m in steps)
    hybrid = sum(m.elastic.num_chunks["hybrid"] for m in steps)
    recomputed = sum(m.elastic.recomputed_layers for m in steps)
    # the full check's 12 Seq1F1B steps of a small model learn; the quick check's 6 steps of a 1.8B-parameter model at
    # lr 3e-4 need not (on an H200, 2026-11-27: 6.39 -> 6.57, a step at 7.95): finite there, falling here
    ok = all(map(math.isfinite, losses)) and (default_path or losses[-1] < losses[0] and split > 0 and hybrid > 0)
    tok = statistics.median(m.tokens_per_s for m in steps[1:])
    ratio = statistics.median(m.elastic.measured_ms / m.elastic.predicted_step_ms for m in steps[1:])
    tflops = [m.tflops_per_gpu for m in steps[1:] if m.tflops_per_gpu is not None]
    retries = sum(m.elastic.oom_retries for m in steps)
    share = binding_share(steps)
    return ok, (f"train: {'ok' if ok else 'FAIL'}: {len(steps)} iterations, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                f"split chunks {split}, hybrid {hybrid}, recomputed layers {recomputed}, "
                + ("" if share is None else f"largest predicted peak {100 * share:.0f} % of the budget (binding: "
                   f"{'yes' if share >= BINDING_SHARE or recomputed else 'no'}), ")
                + f"median {tok:.0f} tokens/s"
                + (f", {statistics.median(tflops):.0f} TFLOP/s" if tflops else "")
                + f", measured/predicted step x{ratio:.2f}, out-of-memory retries {retries}")


# dense bf16 tensor-core peaks by GPU name (NVIDIA's datasheets; the H200 has the H100 SXM's tensor cores)
PEAK_BF16_TFLOPS = {"H100": H100_SXM.peak_tflops, "H200": H100_SXM.peak_tflops}


def peak_tflops(gpu: str | None) -> float | None:
    return next((peak for name, peak in PEAK_BF16_TFLOPS.items() if gpu and name in gpu), None)


def trace_summary(out: Path, name: str) -> dict | None:
    """benchmarks/trace_kernels.py's JSON of the run ``name`` (``trace_metrics.json``, ``trace_metrics_baseline.json``)."""
    text = _text(out / f"trace_{name}.json")
    lines = [line for line in (text or "").splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def kernels_ab(new: dict | None, baseline: dict | None, gpu: str | None, traced: int | None = None) -> dict | None:
    """The new kernels' run against the baseline's, paired by iteration (None: either missing); the medians leave out
    the first iteration and the ``traced`` one (the profiler's)."""
    if not new or not baseline:
        return None
    peak = peak_tflops(gpu)
    before = {e["iteration"]: e for e in baseline["steps"]}
    pairs = []
    for e in new["steps"]:
        b = before.get(e["iteration"])
        if b is None or not e.get("iter_ms") or not b.get("iter_ms"):
            continue
        mfu = [None if peak is None or x.get("tflops") is None else x["tflops"] / peak for x in (e, b)]
        pairs.append({"iteration": e["iteration"], "ms": e["iter_ms"], "baseline_ms": b["iter_ms"], "speedup": b["iter_ms"] / e["iter_ms"],
                      "tflops": e.get("tflops"), "baseline_tflops": b.get("tflops"), "mfu": mfu[0], "baseline_mfu": mfu[1]})
    later = [p for p in pairs[1:] if p["iteration"] != traced] or pairs
    medians = {key: _median([p[key] for p in later if p[key] is not None]) for key in ("speedup", "tflops", "baseline_tflops", "mfu", "baseline_mfu")}
    return {"peak_tflops": peak, "pairs": pairs, "median": medians,
            "attention": [new["lines"].get("attention"), baseline["lines"].get("attention")]}


def bench(out: Path, name: str = "bench") -> dict | None:
    """The last JSON line of ``name``.log (bench_gpu.py's, fused_kernels.py's, longest_trainable.py's)."""
    text = _text(out / f"{name}.log")
    if text is None:
        return None
    lines = [line for line in text.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def report(out: Path) -> dict:
    found = facts(out)
    train = train_figures(out / "metrics.jsonl", out / "train.log")
    baseline = train_figures(out / "metrics_baseline.jsonl", out / "baseline.log")
    offloaded = train_figures(out / "metrics_offload.jsonl", out / "offload.log")
    traces = {"train": trace_summary(out, "metrics"), "baseline": trace_summary(out, "metrics_baseline")}
    traced = next((t["iteration"] for t in traces.values() if t), None)
    return {"report": "gpu_check", "out": str(out), "steps": steps_table(out), "facts": found, "attention": attention(out),
            "equivalence": equivalence(out), "train": train, "baseline": baseline,
            "kernels_ab": kernels_ab(train, baseline, found["gpu"] if found else None, traced), "traces": traces,
            "offload": offloaded, "offload_ab": kernels_ab(offloaded, train, found["gpu"] if found else None, traced),
            "fused": bench(out, "fused"), "longest": bench(out, "longest"), "bench": bench(out)}


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="gpu_check.sh's output folder")
    ap.add_argument("--train", metavar="METRICS", help="print the train step's verdict line for this --epp-metrics file")
    ap.add_argument("--default-path", action="store_true", help="with --train: the --quick run (no profile or budget given)")
    args = ap.parse_args(argv)
    if args.train:
        ok, line = train_verdict(Path(args.train), args.default_path)
        print(line)
        return 0 if ok else 1
    if not args.out:
        ap.error("give OUT_DIR or --train METRICS")
    print(json.dumps(_clean(report(Path(args.out))), allow_nan=False, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
