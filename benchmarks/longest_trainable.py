#!/usr/bin/env python3
"""The longest single document a model really trains on one device, without activation offload and with it (issue 41's
GPU demonstration; on CPU the same at toy sizes), by training it: each probe is one ``pretrain_gpt.py --elastic-pp``
run on a dataset of documents of exactly that length (``--seq-length`` the length, one document a step).

A probe's outcome: ``trained`` (every step trained; the log's allocator peak and the model states against the budget,
the step's ms, the host memory), ``refused`` (the run's start-up check: the planner fits no plan of one document of
that length in ``--epp-memory-budget``, one line before any work), ``oom`` (the device ran out of memory on every
re-plan: the memory model was wrong) or ``error``. Per offload mode (``--modes``, default ``none,checkpoints``): the
length doubled from ``--start`` while it trains, then bisected to ``--resolution`` tokens (training taken as monotone in
the length), at most ``--max-probes`` probes a mode and ``--budget-s`` seconds in all (a probe not started past it).
Then the step time at the longest length every mode trains (both runs again, ``--iters`` steps each, the warm-up
dropped: what offload costs where its plan need not use it) and each mode's own longest run's step time and host
memory.

The model and run flags (``--model-flags``) are those of a ``pretrain_gpt.py`` run (the layers, ``--bf16``, the kernels,
``--epp-loss-chunk-tokens``, ``--epp-mlp-chunk-tokens``), the budget ``--epp-memory-budget`` (GB; a small one keeps
the longest document, and its quadratic attention time, short). The datasets are random bytes (ByteTokenizer) under
``data_cache/longest``. ``--dry-run``: print the probes' command lines, run nothing.

    python -m benchmarks.longest_trainable --model-flags "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --bf16"
        --epp-memory-budget 6 [--modes none,checkpoints] [--start 16384] [--resolution 4096] [--max-probes 6]
        [--budget-s 400] [--iters 3] [--dry-run]

The last line is one JSON object: ``modes`` (per mode ``longest``, ``first_failure``, ``probes``: ``[tokens, outcome,
seconds, detail]``), ``paired`` (the length, each mode's median step ms and offloaded checkpoints), ``config``.
"""

from __future__ import annotations

import json
import shlex
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from benchmarks.common import REPO, Parser, byte_dataset, fail

MODES = ("none", "checkpoints", "auto")


@dataclass
class Probe:
    tokens: int
    outcome: str  # trained | refused | oom | error
    seconds: float
    detail: str = ""
    steps: list = field(default_factory=list)  # the run's StepMetrics (trained)

    def row(self) -> list:
        return [self.tokens, self.outcome, round(self.seconds, 1), self.detail]


def document_dataset(tokens: int, count: int = 4, seed: int = 0) -> str:
    """An indexed dataset of ``count`` random-byte documents of ``tokens`` + 1 tokens (each trains ``tokens`` positions),
    cached under ``data_cache/longest``."""
    return byte_dataset(REPO / "data_cache" / "longest" / f"doc_{tokens}x{count}_{seed}", lambda: [tokens] * count, seed)


def run_argv(model_flags: Sequence[str], tokens: int, mode: str, budget_gb: float, iters: int, data: str) -> list[str]:
    """``pretrain_gpt.py`` flags of one probe: one document of ``tokens`` a step, ``iters`` steps, ``--epp-offload mode``."""
    return ["--elastic-pp", "--pipeline-model-parallel-size", "1", *model_flags, "--data-path", data, "--tokenizer-type",
            "ByteTokenizer", "--split", "1,0,0", "--seq-length", str(tokens), "--max-position-embeddings", str(tokens),
            "--global-batch-size", "1", "--lr", "3e-4", "--train-iters", str(iters), "--log-interval", "1",
            "--epp-memory-budget", repr(budget_gb), "--epp-offload", mode]


def classify(error: str) -> str:
    """A failed run's outcome from its error line."""
    if "out of memory" in error.lower():
        return "oom"
    if "pretrain_gpt.py: error:" in error:
        return "refused"
    return "error"


def real_probe(model_flags: Sequence[str], budget_gb: float, iters: int, timeout: float) -> Callable[[int, str], Probe]:
    """A probe that trains: ``probe(tokens, mode)``."""
    from megatron_epp.training.replay import run_pretrain

    def probe(tokens: int, mode: str) -> Probe:
        t0 = time.perf_counter()
        argv = run_argv(model_flags, tokens, mode, budget_gb, iters, document_dataset(tokens))
        try:
            steps = run_pretrain(argv, nproc=1, timeout=timeout)
        except RuntimeError as error:
            return Probe(tokens, classify(str(error)), time.perf_counter() - t0, str(error)[-300:])
        except Exception as error:  # a timeout: the length is too long to train here  # noqa: BLE001
            return Probe(tokens, "error", time.perf_counter() - t0, f"{type(error).__name__}: {str(error)[:200]}")
        return Probe(tokens, "trained", time.perf_counter() - t0, describe_steps(steps, budget_gb), steps)

    return probe


def describe_steps(steps: list, budget_gb: float) -> str:
    """A trained probe's figures: the largest allocator peak plus model states against the budget, the median step ms,
    the offloaded checkpoints and host memory, the out-of-memory re-plans."""
    e = [s.elastic for s in steps]
    peak = max(max(x.measured_activation_bytes or [0]) + max(x.model_state_bytes or [0]) for x in e) / 2**30
    host = max((max(x.measured_host_bytes or [0]) for x in e), default=0) / 2**30
    return (f"peak {peak:.4g} GB of {budget_gb:g} (model states + measured activations), step ms "
            f"{statistics.median(x.measured_ms for x in e):.0f}, offloaded {max(x.offloaded_layers for x in e)}, host "
            f"{host:.4g} GB, re-plans after out of memory {sum(x.oom_retries for x in e)}")


def search(probe: Callable[[int, str], Probe], mode: str, start: int, resolution: int, max_probes: int,
           deadline: float, log: Callable[[str], None] = print) -> tuple[int, int | None, list[Probe]]:
    """``(longest trained, shortest failed or None, probes)`` for ``mode``: doubling from ``start``, then bisection to
    ``resolution`` (multiples of it), within ``max_probes`` probes and before ``deadline`` (``time.perf_counter``)."""
    good, bad, probes = 0, None, []

    def one(n: int) -> bool:
        p = probe(n, mode)
        probes.append(p)
        log(f"  {mode:11s} {n:>9,d} tokens: {p.outcome} in {p.seconds:.0f} s; {p.detail}")
        return p.outcome == "trained"

    n = start
    while len(probes) < max_probes and time.perf_counter() < deadline:
        if not one(n):
            bad = n
            break
        good, n = n, 2 * n
    while bad is not None and bad - good > resolution and len(probes) < max_probes and time.perf_counter() < deadline:
        mid = (good + bad) // 2 // resolution * resolution
        if mid <= good:
            break
        if one(mid):
            good = mid
        else:
            bad = mid
    return good, bad, probes


def parse(argv: Sequence[str] | None = None):
    ap = Parser(prog="longest_trainable", description=__doc__)
    ap.add_argument("--model-flags", required=True, help="pretrain_gpt.py's model and run flags, one string")
    ap.add_argument("--epp-memory-budget", type=float, required=True, help="GB per device")
    ap.add_argument("--modes", default="none,checkpoints", help=f"comma-separated --epp-offload modes ({', '.join(MODES)})")
    ap.add_argument("--start", type=int, default=16384, help="the first length probed, tokens (default 16384)")
    ap.add_argument("--resolution", type=int, default=4096, help="the bisection's resolution, tokens (default 4096)")
    ap.add_argument("--max-probes", type=int, default=6, help="probes per mode at most (default 6)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="no probe started after this many seconds (default 400)")
    ap.add_argument("--iters", type=int, default=3, help="steps a run, the first a warm-up (default 3)")
    ap.add_argument("--probe-timeout", type=float, default=300.0, help="seconds a run at most (default 300)")
    ap.add_argument("--dry-run", action="store_true", help="print the probes' command lines, run nothing")
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or any(m not in MODES for m in args.modes):
        fail(f"--modes {','.join(args.modes)}: each one of {', '.join(MODES)}")
    for flag in ("start", "resolution", "max_probes", "iters"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be >= 1")
    if args.iters < 2:
        fail("--iters must be >= 2 (the first step is a warm-up)")
    if args.epp_memory_budget <= 0:
        fail("--epp-memory-budget must be positive")
    args.model_flags = shlex.split(args.model_flags)
    return args


def main(argv: Sequence[str] | None = None, probe_factory=real_probe) -> dict:
    args = parse(argv)
    t0 = time.perf_counter()
    print(f"longest_trainable: modes {','.join(args.modes)}, budget {args.epp_memory_budget:g} GB, model {' '.join(args.model_flags)}; "
          f"from {args.start:,} tokens, resolution {args.resolution:,}, at most {args.max_probes} probes a mode, {args.budget_s:g} s",
          flush=True)
    if args.dry_run:
        for mode in args.modes:
            print("pretrain_gpt.py " + " ".join(run_argv(args.model_flags, args.start, mode, args.epp_memory_budget, args.iters,
                                                           "data_cache/longest/doc_START")))
        return {}
    probe = probe_factory(args.model_flags, args.epp_memory_budget, args.iters, args.probe_timeout)
    deadline = t0 + args.budget_s
    found = {}
    for mode in args.modes:
        good, bad, probes = search(probe, mode, args.start, args.resolution, args.max_probes, deadline)
        found[mode] = {"longest": good, "first_failure": bad, "probes": [p.row() for p in probes],
                       "longest_run": next((p.detail for p in probes if p.tokens == good and p.outcome == "trained"), None)}
        print(f"{mode}: longest trained {good:,} tokens" + ("" if bad is None else f"; {bad:,} did not train"), flush=True)
    paired = None
    both = min(f["longest"] for f in found.values())
    if len(args.modes) > 1 and both > 0 and time.perf_counter() < deadline:
        runs = {mode: probe(both, mode) for mode in args.modes}
        paired = {"tokens": both, **{mode: {"outcome": p.outcome, "step_ms": median_step_ms(p), "offloaded": offloaded(p)}
                                     for mode, p in runs.items()}}
        print(f"at {both:,} tokens (every mode trains it): " + "; ".join(
            f"{mode} step {v['step_ms']} ms, offloaded {v['offloaded']}" for mode, v in paired.items() if mode != "tokens"), flush=True)
    out = {"modes": found, "paired": paired, "config": {"model_flags": args.model_flags, "budget_gb": args.epp_memory_budget,
                                                        "start": args.start, "resolution": args.resolution, "iters": args.iters,
                                                        "elapsed_s": round(time.perf_counter() - t0)}}
    print(json.dumps(out))
    return out


def median_step_ms(p: Probe) -> float | None:
    """The median measured step ms of a trained probe, its warm-up step dropped."""
    return None if p.outcome != "trained" else round(statistics.median(s.elastic.measured_ms for s in p.steps[1:] or p.steps), 1)


def offloaded(p: Probe) -> int | None:
    return None if p.outcome != "trained" else max(s.elastic.offloaded_layers for s in p.steps)


if __name__ == "__main__":
    main()
