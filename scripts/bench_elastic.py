#!/usr/bin/env python3
"""Side-by-side: ``--epp-plan elastic`` vs ``megatron`` vs ``seq1f1b`` on the same batches of real lengths.

Runs ``pretrain_gpt.py --elastic-pp`` under torchrun at pp=2 (CPU/gloo, one thread per rank; the
test model's shape: 4 layers, hidden 64, 4 heads, context cap ``--seq-length`` 1024, 16 documents per
global batch), once per plan builder and repeat, all at the same memory budget and on the same
document stream (same data, same seed: step ``i`` trains the same documents under every builder).
Data sets:

* ``stdlib``: the Python standard library's sources (byte tokens, one file per document); files
  longer than the cap are truncated to it (``--epp-truncate-documents``);
* ``wiki``: documents whose lengths are drawn (seeded, with replacement) from
  ``shared/datasets/wikipedia_lengths.txt.gz``; ``--wiki-mode clip`` (default) keeps the tokenized
  lengths and clips them to the cap (short documents keep their real size; 21 % of documents hit a
  cap of 1024), ``--wiki-mode scale`` multiplies them by cap / 128K first (the shape of the length
  distribution relative to a 128K context; most documents become a few tokens). Tokens are random
  bytes, written once as an indexed dataset under ``data_cache/bench/``.

Per builder it prints the plan (median chunks by kind, pipelines, recomputed layers, predicted ms),
the medians of the iteration time (whole step: waiting for the plan, pipeline, optimizer), of the
pipeline time (``measured ms``: ``forward_backward_elastic``) and of the measured peak activation
memory per stage, and the ratios baseline / elastic (> 1: elastic is faster / uses less memory):
per step over the same batch, median over steps. Each step's time is the median over repeats; the
first step of every run is warm-up and dropped.

    python scripts/bench_elastic.py [--quick] [--repeats 3] [--iters 6] [--epp-memory-budget 0.05]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_epp.tools.calibration import REPO, run_pretrain  # noqa: E402

BUILDERS = ("elastic", "megatron", "seq1f1b")


def wiki_dataset(mode: str, cap: int, num_docs: int = 4096, seed: int = 0) -> str:
    """Indexed dataset of random-byte documents with Wikipedia lengths (clipped or scaled to ``cap``)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
    from megatron_epp.data.mock_documents import WIKIPEDIA_LENGTHS, lengths_from_file

    prefix = REPO / "data_cache" / "bench" / f"wiki_{mode}_{cap}_{num_docs}_{seed}"
    if Path(get_idx_path(str(prefix))).exists():
        return str(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    scale = 1.0 if mode == "clip" else cap / 131072
    # +1: a document of n + 1 tokens trains as n tokens (inputs/labels shifted by one)
    lengths = lengths_from_file(WIKIPEDIA_LENGTHS, num_docs, seed, scale=scale, max_length=cap + 1)
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=DType.optimal_dtype(257))
    for n in lengths:
        ids = rng.integers(0, 256, size=int(n), dtype=np.int64)
        builder.add_document(ids, [ids.size])
    builder.finalize(get_idx_path(str(prefix)))
    return str(prefix)


def data_flags(name: str, args) -> list[str]:
    if name == "stdlib":
        from megatron_epp.data.stdlib_corpus import ensure_stdlib_corpus

        path = ensure_stdlib_corpus(progress=False)
        return ["--data-path", path, "--tokenizer", "byte", "--split", "1,0,0", "--epp-truncate-documents"]
    return ["--data-path", wiki_dataset(args.wiki_mode, args.seq_length), "--tokenizer", "byte", "--split", "1,0,0"]


def run_builder(data: list[str], builder: str, args) -> list:
    argv = ["--elastic-pp", *data, "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", str(args.seq_length), "--global-batch-size", str(args.gbs),
            "--lr", "3e-3", "--train-iters", str(args.iters + 1), "--log-interval", "1",
            "--epp-memory-budget", str(args.epp_memory_budget), "--epp-plan", builder]
    if builder == "seq1f1b":
        argv += ["--epp-max-slices", str(args.epp_max_slices)]
    return run_pretrain(argv)[1:]  # drop the warm-up step


def med(x) -> float:
    return float(np.median(np.asarray(x, dtype=float)))


def bench_dataset(name: str, args) -> None:
    data = data_flags(name, args)
    runs: dict[str, list[list]] = {b: [] for b in args.builders}
    failed: dict[str, str] = {}
    for r in range(args.repeats):
        order = args.builders[r % len(args.builders):] + args.builders[: r % len(args.builders)]  # rotate: spread drift
        for b in order:
            if b in failed:
                continue
            try:
                runs[b].append(run_builder(data, b, args))
            except RuntimeError as error:
                failed[b] = str(error)
    print(f"\n== {name}: {len(data) and ' '.join(data[:2])} | cap {args.seq_length}, {args.gbs} documents per step, "
          f"budget {args.epp_memory_budget} GB per stage, {args.iters} steps x {args.repeats} repeats")
    stats = {}
    for b in args.builders:
        if b in failed:
            print(f"  {b:9s} does not run: {failed[b]}")
            continue
        steps = runs[b]
        n = min(len(s) for s in steps)
        iter_ms = np.array([[s[i].iter_ms for s in steps] for i in range(n)])  # (step, repeat)
        pipe_ms = np.array([[s[i].elastic.measured_ms for s in steps] for i in range(n)])
        act = np.array([s[i].elastic.measured_activation_bytes for s in steps for i in range(n)]) / 2**20  # (step*repeat, stage)
        first = steps[0][:n]
        stats[b] = {"iter": np.median(iter_ms, 1), "pipe": np.median(pipe_ms, 1), "act": np.median(act, 0),
                    "tokens": [s.tokens for s in first]}
        kinds = {k: med([s.elastic.num_chunks[k] for s in first]) for k in ("batched", "split", "hybrid")}
        pred = [s.elastic.predicted_step_ms for s in first if s.elastic.predicted_step_ms is not None]
        print(f"  {b:9s} plan: {med([sum(s.elastic.num_chunks.values()) for s in first]):.0f} chunks (batched {kinds['batched']:.0f}, split "
              f"{kinds['split']:.0f}, hybrid {kinds['hybrid']:.0f}), {med([s.elastic.num_pipelines for s in first]):.0f} pipeline(s), "
              f"{med([s.elastic.recomputed_layers for s in first]):.0f} recomputed layers, predicted {med(pred):.0f} ms (median per step)")
    if "elastic" not in stats:
        return
    e = stats["elastic"]
    print(f"  {'builder':9s} {'iter ms':>8s} {'pipe ms':>8s} {'act MB per stage':>18s} | {'iter x':>7s} {'pipe x':>7s} {'act x per stage':>16s}")
    for b, s in stats.items():
        k = min(len(s["iter"]), len(e["iter"]))
        same = all(a == c for a, c in zip(s["tokens"][:k], e["tokens"][:k]))
        ratio_iter = med(s["iter"][:k] / e["iter"][:k])
        ratio_pipe = med(s["pipe"][:k] / e["pipe"][:k])
        act = " ".join(f"{a:.1f}" for a in s["act"])
        ract = " ".join(f"{a / c:.2f}" for a, c in zip(s["act"], e["act"]))
        print(f"  {b:9s} {med(s['iter']):8.0f} {med(s['pipe']):8.0f} {act:>18s} | {ratio_iter:7.2f} {ratio_pipe:7.2f} {ract:>16s}"
              + ("" if same else "  (batches differ!)"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 repeat of 3 steps (about 2 minutes on 2 cores)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per builder and data set (default 2)")
    ap.add_argument("--iters", type=int, default=None, help="measured steps per run (default 5), after one warm-up step")
    ap.add_argument("--datasets", default="stdlib,wiki")
    ap.add_argument("--builders", default=",".join(BUILDERS))
    ap.add_argument("--epp-memory-budget", type=float, default=0.05, help="--epp-memory-budget for every builder")
    ap.add_argument("--seq-length", type=int, default=1024, help="context cap")
    ap.add_argument("--gbs", type=int, default=16, help="documents per global batch")
    ap.add_argument("--epp-max-slices", type=int, default=4, help="Seq1F1B's slice count k")
    ap.add_argument("--wiki-mode", choices=["clip", "scale"], default="clip")
    args = ap.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.iters = args.iters or (3 if args.quick else 5)
    args.builders = args.builders.split(",")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"bench_elastic: pp=2, 1 thread per rank, {os.cpu_count()} cores, load average {load:.2f} at start")
    t0 = time.perf_counter()
    for name in args.datasets.split(","):
        bench_dataset(name, args)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n{time.perf_counter() - t0:.0f} s; load average {load:.2f} at the end. ratios: baseline / elastic, "
          "median over steps of the per-step ratio (> 1: elastic faster / smaller)")


if __name__ == "__main__":
    main()
