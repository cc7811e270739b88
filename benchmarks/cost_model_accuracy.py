"""Cost-model accuracy on this CPU: predicted vs measured forward+backward time of real chunks.

Plans a batch of Wikipedia lengths for the test model with the shipped CPU profile, takes chunks of
every kind (batched, split with context, hybrid) and runs each through the real Megatron-Core
layers (8 layers with prefix-K/V attention, plus the output head and loss), one thread, timed as
process CPU time (min of repeats). Compares with the cost model's prediction of the same chunk on a
single stage holding all layers.

    python -m benchmarks.cost_model_accuracy [--per-kind 6] [--epp-profile PATH]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch


from megatron_epp.cost.model import CostModel
from megatron_epp.base.units import GIB
from megatron_epp.cost.profile_lookup import load_profile
from megatron_epp.planner import build_plan
from megatron_epp.data.mock_documents import WIKIPEDIA_LENGTHS
from megatron_epp.data.lengths import read_lengths
from megatron_epp.cost.features import chunk_features
from megatron_epp.measure.layer_bench import LayerStack, init_single_process, time_fwd_bwd
from benchmarks.common import Parser


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epp-profile", default="test-model")
    ap.add_argument("--per-kind", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    init_single_process()
    profile = load_profile(args.epp_profile)
    lengths = np.minimum(np.random.default_rng(args.seed).choice(read_lengths(WIKIPEDIA_LENGTHS), 96), 8192)
    plan = build_plan(lengths, CostModel(profile, 2), 0.25 * GIB).plan
    whole = CostModel(profile, 1)  # one stage holding every layer and the head
    stack = LayerStack(profile.model, profile.model.num_layers)
    rows = []
    for kind in ("batched", "split", "hybrid"):
        chunks = [c for c in plan.chunks() if c.kind == kind]
        for c in chunks[:: max(1, len(chunks) // args.per_kind)][: args.per_kind]:
            costs = whole.costs(chunk_features([c]))
            predicted = float(costs.fwd[0, 0] + costs.bwd[0, 0])
            stack.set_segments(c.lengths, c.contexts)
            x = lambda n=c.num_tokens: (torch.randn(n, 1, profile.model.hidden, requires_grad=True),)
            f, b = time_fwd_bwd(lambda t: stack.head_loss(stack(t)), x, args.repeats)
            rows.append((kind, c.num_tokens, len(c.segments), max(c.contexts), predicted, f + b))
    print(f"{'kind':8s} {'tokens':>7s} {'segs':>5s} {'max C':>6s} {'pred ms':>9s} {'meas ms':>9s} {'err':>7s}")
    errs = {}
    for kind, tok, segs, ctx, pred, meas in rows:
        err = pred / meas - 1
        errs.setdefault(kind, []).append(err)
        print(f"{kind:8s} {tok:7d} {segs:5d} {ctx:6d} {pred:9.1f} {meas:9.1f} {err:+7.1%}")
    allerr = np.abs(np.concatenate([np.array(v) for v in errs.values()]))
    for kind, e in errs.items():
        print(f"{kind:8s} mean |err| {np.mean(np.abs(e)):.1%}  max {np.max(np.abs(e)):.1%}  ({len(e)} chunks)")
    print(f"all      mean |err| {allerr.mean():.1%}  max {allerr.max():.1%}  within 10 %: {int((allerr <= 0.10).sum())}/{len(allerr)}")


if __name__ == "__main__":
    main()
