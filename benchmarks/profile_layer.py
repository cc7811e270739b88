"""Profile Megatron-Core's transformer layer on this machine and fit the planner's cost model.

Measures, with one thread (process CPU time, fastest of ``--repeats``):
  * the layer that trains (the training spec through ``elastic_layer_spec``: ``ChunkRecomputeLayer``,
    ``ElasticAttention`` with one SDPA call per segment under a bottom-right causal mask, the prefix
    K/V concatenated for a slice with context, RoPE when the shape has it), forward and backward, on
    real chunks of every kind: batched (one and many segments), split (a slice of ``s`` tokens over
    ``C`` tokens of prefix), hybrid (a tail slice packed with short sequences);
    every coefficient of the cost model (:class:`TimeCoeffs`, the columns ``F`` of
    ``megatron_epp.cost.features``: ``sum s^2``, ``sum s*C``, ``sum s``, ``sum C``, segments, chunks)
    is fitted jointly on these chunks' features by non-negative least squares of the relative error.
    Each term is reported with its bootstrap relative error and its share of the fitted time, and a
    term fitted to 0 is named in a warning (NNLS clips a term the data would make negative: it must
    not pass unseen). The fit is checked for a per-slice term the model does not have (a constant
    per chunk holding a slice with context): the split and hybrid chunks' residuals are refitted
    with it and the script says whether they ask for it;
  * recompute = (forward+backward recomputing as training does) - (forward+backward), fitted on its own
    per-token and per-chunk terms plus the forward's attention part (``cost.profile_fit.recompute_fit``);
  * the output head (linear + cross entropy) forward/backward, on the per-token and per-chunk columns;
  * the bytes autograd saves per layer and for the head: a check only, the profile's memory block is
    the analytic count (``saved_tensor_memory``, ``derive="saved-tensors"``), which the planner
    re-derives for any shape (the trained shape's dropout included: the layers here run without dropout);
    the error of the count against these measurements is reported.

Writes the profile JSON (keeping the ``overhead`` block of the file it replaces, or of the shipped
profile, fitted on real steps by ``benchmarks/calibrate_step.py``) and prints every fit's error.

    python -m benchmarks.profile_layer --out megatron_epp/cost/profiles/test-model_cpu.json
    python -m benchmarks.profile_layer --hidden-size 128 --out /tmp/h128.json        # another shape
    python -m benchmarks.profile_layer --hidden-size 128 --compare test-model         # check time scaling

``--compare PROFILE`` profiles nothing: it times real chunks (batched, split with context, hybrid)
through one layer, and the output head, at the given shape and compares them with PROFILE's
coefficients carried to that shape by the planner's FLOP scaling (``shape_time``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
from pathlib import Path

import numpy as np
import torch


from megatron_epp.measure.layer_bench import LayerStack, init_single_process, saved_bytes, time_fwd_bwd
from megatron_epp.cost.profile_fit import fit, measured_profile, recompute_fit, rel_errors
from megatron_epp.cost.features import NUM_FEATURES, F, chunk_features
from megatron_epp.plan import Chunk, Segment
from megatron_epp.cost.activation_memory import saved_tensor_memory
from megatron_epp.cost.analytic import shape_time
from megatron_epp.cost.profile import MemoryCoeffs, StageOverhead, TimeCoeffs
from megatron_epp.cost.profile_lookup import TEST_MODEL_PROFILE, load_profile
from megatron_epp.cost.shape import TEST_MODEL, ModelShape
from benchmarks.common import Parser


TERMS = [c.name for c in F]  # the feature columns: SQ SC S C SEGMENTS CHUNKS
COEFF_NAMES = [f.name for f in dataclasses.fields(TimeCoeffs)]  # their coefficients: a1 a1c a2 ac bs b1


def fit_terms(X: np.ndarray, y: np.ndarray, kinds: list[str], boot: int = 200) -> tuple[np.ndarray, dict]:
    """:func:`fit` on every column of ``X``, with a report: the error overall and per chunk kind, and per
    term its value, its bootstrap relative error (std over ``boot`` resamples of the chunks / value)
    and its share of the fitted time of all chunks; ``zero``: the terms with data fitted to exactly 0."""
    coef, err = fit(X, y)
    rng = np.random.default_rng(0)
    draws = np.array([fit(X[i], y[i])[0] for i in (rng.integers(0, len(y), len(y)) for _ in range(boot))])
    share = (X * coef).sum(axis=0) / (X @ coef).sum()
    rel = X @ coef / y - 1
    err["kinds"] = {k: rel_errors((X @ coef)[sel], y[sel]) | {"mean_rel_err": float(rel[sel].mean())}
                    for k in dict.fromkeys(kinds) for sel in [np.array(kinds) == k]}
    err["terms"] = {name: {"value": float(c), "rel_std": float(d.std() / c) if c > 0 else None, "share": float(sh)}
                    for name, c, d, sh in zip(COEFF_NAMES, coef, draws.T, share)}
    err["zero"] = [COEFF_NAMES[j] + f" ({TERMS[j]})" for j in np.flatnonzero((coef == 0) & (np.abs(X).sum(axis=0) > 0))]
    return coef, err


def per_slice_check(X: np.ndarray, y: np.ndarray) -> dict:
    """Do the split and hybrid chunks ask for a per-slice term (a constant per chunk holding a slice with
    context, which the model lacks)? Refit with that column; it is asked for when it takes more than a
    quarter, and more than a point, off their rms error."""
    ctx = X[:, F.C] > 0
    without = rel_errors((X @ fit(X, y)[0])[ctx], y[ctx])["rms_rel_err"]
    Xs = np.column_stack([X, ctx.astype(float)])
    coef, _ = fit(Xs, y)
    with_it = rel_errors((Xs @ coef)[ctx], y[ctx])["rms_rel_err"]
    return {"rms_rel_err_without": without, "rms_rel_err_with": with_it, "ms_per_slice": float(coef[-1]),
            "asked": bool(with_it < 0.75 * without and without - with_it > 0.01), "points": int(ctx.sum())}


# chunks the layer is timed on, by kind: (lengths, contexts), at most one segment with context each;
# together they vary every feature column independently (many-segment chunks part segments from chunks)
FIT_CHUNKS = {
    "batched": [([s], [0]) for s in (32, 64, 128, 256, 512, 1024, 1536, 2048, 3072)]
    + [([64] * 16, [0] * 16), ([128] * 8, [0] * 8), ([256] * 4, [0] * 4), ([32] * 32, [0] * 32),
       ([1024, 512, 256, 128, 64, 32], [0] * 6), ([1536, 512], [0, 0])],
    "split": [([s], [c]) for s in (64, 256, 512, 1024, 2048) for c in (512, 2048, 4096, 8192)],
    "hybrid": [([512, 256, 128], [1536, 0, 0]), ([256, 1024], [1024, 0]), ([1024, 64, 64, 64], [3072, 0, 0, 0]),
               ([128, 512, 512], [4096, 0, 0]), ([64] + [32] * 16, [6144] + [0] * 16)],
}


def time_chunk(stack: LayerStack, lengths: list[int], contexts: list[int], repeats: int, checkpoint: bool = False) -> tuple[float, float]:
    """Forward and backward ms of ``stack`` on the chunk of segments ``(s, C)``."""
    stack.set_segments(lengths, contexts)
    n = sum(lengths)
    return time_fwd_bwd(lambda t: stack(t, checkpoint=checkpoint), lambda: (torch.randn(n, 1, stack.shape.hidden, requires_grad=True),), repeats)


def segments_chunk(lengths: list[int], contexts: list[int]) -> Chunk:
    """The chunk of segments ``(s, C)`` (its kind does not enter its features)."""
    return Chunk(0, "batched", [Segment(i, c, c + s) for i, (s, c) in enumerate(zip(lengths, contexts))])


def profile_layer(shape: ModelShape, repeats: int):
    """Fit every forward and backward coefficient of the layer jointly on :data:`FIT_CHUNKS`, and the
    recompute/forward ratio on the batched one-segment chunks."""
    stack = LayerStack(shape, num_layers=1)
    kinds, feats, tf, tb, trc = [], [], [], [], []
    for kind, chunks in FIT_CHUNKS.items():
        for lengths, contexts in chunks:
            f, b = time_chunk(stack, lengths, contexts, repeats)
            kinds.append(kind)
            feats.append(chunk_features([segments_chunk(lengths, contexts)])[0])
            tf.append(f)
            tb.append(b)
            if kind == "batched" and len(lengths) == 1:
                fck, bck = time_chunk(stack, lengths, contexts, repeats, checkpoint=True)
                trc.append(fck + bck - f - b)
    X = np.array(feats)
    out = {}
    for name, t in (("fwd", tf), ("bwd", tb)):
        coef, err = fit_terms(X, np.array(t), kinds)
        out[name] = (TimeCoeffs(*coef), err)
    single = np.array([k == "batched" and x[F.SEGMENTS] == 1 for k, x in zip(kinds, X)])
    out["recompute"] = recompute_fit(X[single, F.S], np.array(trc), out["fwd"][0])
    out["per_slice_term"] = {name: per_slice_check(X, np.array(t)) for name, t in (("fwd", tf), ("bwd", tb))}
    return out, stack


def profile_head(shape: ModelShape, stack: LayerStack, repeats: int):
    lengths = np.array([64, 256, 512, 1024, 2048], dtype=float)
    tf, tb = [], []
    for s in lengths.astype(int):
        x = lambda s=s: (torch.randn(s, 1, shape.hidden, requires_grad=True),)
        f, b = time_fwd_bwd(stack.head_loss, x, repeats)
        tf.append(f)
        tb.append(b)
    X = np.zeros((len(lengths), NUM_FEATURES))
    X[:, F.S], X[:, F.CHUNKS] = lengths, 1.0  # the head: per token and per chunk
    res = {}
    for name, t in (("head_fwd", tf), ("head_bwd", tb)):
        coef, err = fit_terms(X, np.array(t), ["head"] * len(lengths))
        res[name] = (TimeCoeffs(*coef), err)
    return res


def derived_memory(shape: ModelShape) -> MemoryCoeffs:
    """The profile's memory block: the analytic saved-tensor count for ``shape`` (fp32, CPU), which
    the planner re-derives for the trained shape (``shape_memory``), and fp32 model states."""
    return MemoryCoeffs(
        **saved_tensor_memory(shape, 1), weight=4.0, grad=4.0, optim=8.0, distributed_optimizer=False,
        p2p_token=4.0 * shape.hidden, derive="saved-tensors",
    )


def check_memory(shape: ModelShape, stack: LayerStack, memory: MemoryCoeffs) -> dict:
    """Bytes autograd saves per layer (chunks of one segment, with and without context) and for the
    head, against the derived count (a slice's count includes the K/V buffer the stack gives it)."""
    m, pred, meas = memory, [], []
    for s, c in [(128, 0), (256, 0), (512, 0), (1024, 0), (2048, 0), (256, 512), (256, 2048), (512, 1024), (1024, 2048)]:
        stack.set_segments([s], [c])
        x = torch.randn(s, 1, shape.hidden, requires_grad=True)
        meas.append(saved_bytes(lambda: stack(x), stack.context))
        lone, buffer = (m.lone_slice_token * s, m.kv_token * (c + s)) if c else (0.0, 0.0)
        pred.append(m.act_token * s + m.act_area * s * (c + s) + m.act_context * c + (m.act_slice * s if c else 0.0) - lone + buffer)
    logits = saved_bytes(lambda: stack.head_loss(torch.randn(1024, 1, shape.hidden, requires_grad=True))) / 1024
    # the bench head is the last stage's (final norm, output layer, megatron-core's cross entropy, loss mask): logits_token
    return {"activation_bytes_derived": rel_errors(pred, meas), "logits_bytes_derived": rel_errors([m.logits_token], [logits])}


# chunks for --compare: (lengths, contexts); at most one segment with context per chunk
COMPARE_CHUNKS = {
    "batched": [([2048], [0]), ([1024, 512, 256, 128, 64, 32], [0] * 6), ([128] * 8, [0] * 8), ([256], [0])],
    "split": [([512], [1536]), ([1024], [1024]), ([256], [3840]), ([2048], [2048])],
    "hybrid": [([512, 256, 128], [1536, 0, 0]), ([256, 1024], [1024, 0])],
}


def compare(shape: ModelShape, spec: str, repeats: int) -> None:
    """Measured vs predicted (``spec``'s coefficients carried to ``shape``) per-layer forward+backward
    of real chunks, and of the output head."""
    base = load_profile(spec)
    profile = shape_time(dataclasses.replace(base, model=dataclasses.replace(shape, name=base.model.name, rope=base.model.rope)))
    stack = LayerStack(shape, num_layers=1)
    print(f"shape: hidden {shape.hidden}, heads {shape.num_heads}, ffn {shape.ffn_hidden}, vocab {shape.vocab}; "
          f"coefficients of {spec} (hidden {base.time_model.hidden}) scaled by FLOPs")
    print(f"{'kind':8s} {'tokens':>7s} {'segs':>5s} {'max C':>6s} {'pred ms':>9s} {'meas ms':>9s} {'err':>7s}")
    errs = {}
    for kind, chunks in COMPARE_CHUNKS.items():
        for lengths, contexts in chunks:
            feats = chunk_features([segments_chunk(lengths, contexts)])[0]
            pred = float(feats @ (profile.fwd.vector() + profile.bwd.vector()))
            f, b = time_chunk(stack, lengths, contexts, repeats)
            errs.setdefault(kind, []).append(pred / (f + b) - 1)
            print(f"{kind:8s} {sum(lengths):7d} {len(lengths):5d} {max(contexts):6d} {pred:9.2f} {f + b:9.2f} {pred / (f + b) - 1:+7.1%}")
    for n in (512, 2048):
        f, b = time_fwd_bwd(stack.head_loss, lambda n=n: (torch.randn(n, 1, shape.hidden, requires_grad=True),), repeats)
        feats = np.zeros(NUM_FEATURES)
        feats[[F.S, F.CHUNKS]] = n, 1.0  # the head: per token and per chunk
        pred = float(feats @ (profile.head_fwd.vector() + profile.head_bwd.vector()))
        errs.setdefault("head", []).append(pred / (f + b) - 1)
        print(f"{'head':8s} {n:7d} {1:5d} {0:6d} {pred:9.2f} {f + b:9.2f} {pred / (f + b) - 1:+7.1%}")
    for kind, e in errs.items():
        print(f"{kind:8s} mean err {np.mean(e):+.1%}  mean |err| {np.mean(np.abs(e)):.1%}  max |err| {np.max(np.abs(e)):.1%}")


def report_fit(name: str, err: dict) -> None:
    """One fit's errors, overall, per chunk kind and per term; a warning for every term fitted to 0."""
    kinds = ", ".join(f"{k} {e['rms_rel_err']:.1%} (mean {e['mean_rel_err']:+.1%})" for k, e in err["kinds"].items())
    print(f"  {name:9s} rms rel err {err['rms_rel_err']:6.1%}  max {err['max_rel_err']:6.1%}  ({err['points']} chunks; rms by kind: {kinds})")
    for term, column in zip(err["terms"], TERMS):
        t = err["terms"][term]
        spread = f"{t['rel_std']:8.1%}" if t["rel_std"] is not None else f"{'-':>8s}"
        print(f"      {term:4s} ({column:8s}) {t['value']:11.4g} ms   bootstrap rel err {spread}   share of time {t['share']:6.1%}")
    for term in err["zero"]:
        print(f"  WARNING: {name}: {term} fitted to 0 (non-negative least squares clipped it: the chunks give it no time)")


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(TEST_MODEL_PROFILE))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden-size", type=int, default=TEST_MODEL.hidden)
    ap.add_argument("--num-attention-heads", type=int, default=TEST_MODEL.num_heads)
    ap.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    ap.add_argument("--vocab-size", type=int, default=TEST_MODEL.vocab)
    ap.add_argument("--overhead-from", default=None,
                    help="profile JSON whose 'overhead' block is kept (default: --out if it exists, else the shipped profile)")
    ap.add_argument("--compare", metavar="PROFILE", default=None,
                    help="profile nothing: compare PROFILE, scaled to this shape, with measured chunks")
    args = ap.parse_args(argv)
    shape = dataclasses.replace(TEST_MODEL, hidden=args.hidden_size, num_heads=args.num_attention_heads, ffn_hidden=args.ffn_hidden_size or 4 * args.hidden_size, vocab=args.vocab_size)
    if shape != TEST_MODEL:
        shape = dataclasses.replace(shape, name=f"{TEST_MODEL.name}-h{shape.hidden}")
    init_single_process()  # one thread before anything is timed
    torch.manual_seed(0)
    if args.compare:
        compare(shape, args.compare, args.repeats)
        return
    overhead_from = Path(args.overhead_from or (args.out if Path(args.out).exists() else TEST_MODEL_PROFILE))
    overhead = json.loads(overhead_from.read_text()).get("overhead")
    layer, stack = profile_layer(shape, args.repeats)
    head = profile_head(shape, stack, args.repeats)
    memory = derived_memory(shape)
    kernel = "+".join(sorted(set(stack.context.attention_backends.values())))  # the attention kernel timed (sdpa-merged)
    errors = {k: v[1] for k, v in {**layer, **head}.items() if k != "per_slice_term"}
    errors["per_slice_term"] = layer["per_slice_term"]
    errors.update(check_memory(shape, stack, memory))
    profile = measured_profile(shape, f"CPU {platform.processor() or platform.machine()} (1 thread, fp32, {kernel})", layer, head, memory,
                               {"errors": errors, "torch": torch.__version__, "note": "measured by benchmarks/profile_layer.py"},
                               StageOverhead(**overhead) if overhead else StageOverhead())
    profile.save(args.out)
    print(f"wrote {args.out}\nlayer and head, fitted jointly on the chunk features (non-negative least squares, relative error):")
    for name in ("fwd", "bwd", "head_fwd", "head_bwd"):
        report_fit(name, errors[name])
    for name, check in errors["per_slice_term"].items():
        verdict = "asked for: the cost model has no such term" if check["asked"] else "not asked for"
        print(f"  per-slice term ({name}): split/hybrid rms rel err {check['rms_rel_err_without']:.1%} without, "
              f"{check['rms_rel_err_with']:.1%} with {check['ms_per_slice']:.3g} ms per slice ({check['points']} chunks): {verdict}")
    for name in ("recompute", "activation_bytes_derived", "logits_bytes_derived"):
        e = errors[name]
        print(f"  {name:24s} rms rel err {e['rms_rel_err']:6.1%}   max {e['max_rel_err']:6.1%}   ({e['points']} points)")


if __name__ == "__main__":
    main()
