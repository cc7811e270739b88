"""Profile Megatron-Core's transformer layer on this machine and fit the planner's cost model.

Measures, with one thread:
  * ``scaled_dot_product_attention`` of ``s`` queries over ``C + s`` keys (prefix K/V concatenated,
    bottom-right causal boolean mask), forward and backward, over an ``(s, C)`` grid: fits the
    attention coefficients ``a1`` (s^2), ``a1c`` (s*C), ``ac`` (C) and the per-segment constant;
  * the layer that trains (the training spec through ``elastic_layer_spec``: ``ChunkRecomputeLayer``,
    this attention, RoPE when the shape has it) at ``C = 0`` over lengths: fits the linear term
    ``a2`` and the constant ``b1`` after removing the attention's quadratic part; recompute =
    (forward+backward recomputing as training does) - (forward+backward), fitted as a ratio of the
    forward;
  * the output head (linear + cross entropy) forward/backward;
  * the bytes autograd saves per layer and for the head: a check only, the profile's memory block is
    the analytic count (``saved_tensor_memory``, ``derive="saved-tensors"``), which the planner
    re-derives for any shape; the error of the count against these measurements is reported.

Writes the profile JSON (keeping the ``overhead`` block of the file it replaces, or of the shipped
profile, fitted on real steps by ``scripts/calibrate_step.py``) and prints every fit's error.

    python scripts/profile_layer.py --out megatron_epp/cost/profiles/test-model_cpu.json
    python scripts/profile_layer.py --hidden-size 128 --out /tmp/h128.json        # another shape
    python scripts/profile_layer.py --hidden-size 128 --compare test-model         # check time scaling

``--compare PROFILE`` profiles nothing: it times real chunks (batched, split with context, hybrid)
through one layer, and the output head, at the given shape and compares them with PROFILE's
coefficients carried to that shape by the planner's FLOP scaling (``shape_time``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import nnls

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_epp.executor.kernels import segment_attention  # noqa: E402
from megatron_epp.executor.context import bottom_right_causal_mask  # noqa: E402
from megatron_epp.tools.layer_bench import LayerStack, init_single_process, saved_bytes, time_fwd_bwd  # noqa: E402
from megatron_epp.cost.features import NUM_FEATURES, F, chunk_features  # noqa: E402
from megatron_epp.cost.profiles import (  # noqa: E402
    PROFILE_DIR, TEST_MODEL, MemoryCoeffs, ModelShape, Profile, StageOverhead, TimeCoeffs, load_profile,
    saved_tensor_memory, shape_time,
)


def fit(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """Non-negative least squares on relative error; returns coefficients and error stats."""
    A = X / y[:, None]
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(A / scale, np.ones_like(y))[0] / scale
    rel = X @ coef / y - 1.0
    return coef, {"rms_rel_err": float(np.sqrt(np.mean(rel**2))), "max_rel_err": float(np.max(np.abs(rel))), "points": len(y)}


def profile_attention(shape: ModelShape, repeats: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Fit ``[a1, a1c, a_lin, ac, bs]`` for attention forward and backward."""
    heads, d = shape.num_heads, shape.hidden // shape.num_heads
    rows, tf, tb = [], [], []
    for s in (64, 256, 512, 1024, 2048, 3072):
        for c in (0, 1024, 2048, 4096, 8192):

            def make(s: int = s, c: int = c) -> tuple[torch.Tensor, ...]:
                return tuple(torch.randn(n, 1, heads, d, requires_grad=True) for n in (s, s, s, c, c))

            def run(q, k, v, pk, pv, s: int = s, c: int = c) -> torch.Tensor:
                return segment_attention(q, torch.cat([pk, k]), torch.cat([pv, v]), bottom_right_causal_mask(s, c))

            f, b = time_fwd_bwd(run, make, repeats)
            rows.append([s * s, s * c, s, c, 1.0])
            tf.append(f)
            tb.append(b)
    X = np.array(rows, dtype=float)
    cf, ef = fit(X, np.array(tf))
    cb, eb = fit(X, np.array(tb))
    return cf, cb, {"attention_fwd": ef, "attention_bwd": eb}


def profile_layer(shape: ModelShape, att_f: np.ndarray, att_b: np.ndarray, repeats: int):
    """Fit the layer's ``a2``/``b1`` (forward, backward) and the recompute/forward ratio."""
    stack = LayerStack(shape, num_layers=1)
    lengths = np.array([32, 64, 128, 256, 512, 1024, 1536, 2048, 3072], dtype=float)
    tf, tb, trc = [], [], []
    for s in lengths.astype(int):
        stack.set_segments([s], [0])
        x = lambda s=s: (torch.randn(s, 1, shape.hidden, requires_grad=True),)
        f, b = time_fwd_bwd(stack, x, repeats)
        fck, bck = time_fwd_bwd(lambda t: stack(t, checkpoint=True), x, repeats)
        tf.append(f)
        tb.append(b)
        trc.append(fck + bck - f - b)
    out = {}
    X = np.stack([lengths, np.ones_like(lengths)], 1)
    for name, t, att in (("fwd", tf, att_f), ("bwd", tb, att_b)):
        t = np.array(t)
        quad = att[0] * lengths**2 + att[4]  # attention's s^2 term and per-segment constant
        (a2, b1), _ = fit(X, np.maximum(t - quad, 1e-6))
        pred = quad + a2 * lengths + b1
        rel = pred / t - 1
        out[name] = (TimeCoeffs(att[0], att[1], a2, att[3], att[4], b1), {"rms_rel_err": float(np.sqrt(np.mean(rel**2))), "max_rel_err": float(np.abs(rel).max()), "points": len(t)})
    fc = out["fwd"][0]
    fwd_pred = fc.a1 * lengths**2 + fc.a2 * lengths + fc.bs + fc.b1
    (ratio, extra), err = fit(np.stack([fwd_pred, np.ones_like(lengths)], 1), np.array(trc))
    out["recompute"] = (TimeCoeffs(*(fc.vector() * ratio + np.eye(NUM_FEATURES)[F.CHUNKS] * extra)), {**err, "ratio_to_fwd": ratio})
    return out, stack


def profile_head(shape: ModelShape, stack: LayerStack, repeats: int):
    lengths = np.array([64, 256, 512, 1024, 2048], dtype=float)
    tf, tb = [], []
    for s in lengths.astype(int):
        x = lambda s=s: (torch.randn(s, 1, shape.hidden, requires_grad=True),)
        f, b = time_fwd_bwd(stack.head_loss, x, repeats)
        tf.append(f)
        tb.append(b)
    X = np.stack([lengths, np.ones_like(lengths)], 1)
    res = {}
    for name, t in (("head_fwd", tf), ("head_bwd", tb)):
        (a2, b1), err = fit(X, np.array(t))
        res[name] = (TimeCoeffs(0.0, 0.0, a2, 0.0, 0.0, b1), err)
    return res


def rel_errors(pred: np.ndarray, meas: np.ndarray) -> dict[str, float]:
    rel = np.asarray(pred, dtype=float) / np.asarray(meas, dtype=float) - 1.0
    return {"rms_rel_err": float(np.sqrt(np.mean(rel**2))), "max_rel_err": float(np.max(np.abs(rel))), "points": len(rel)}


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
    # the bench head is the output layer + cross entropy (no final layernorm, no loss mask)
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
    from megatron_epp.plan import Chunk, Segment

    base = load_profile(spec)
    profile = shape_time(dataclasses.replace(base, model=dataclasses.replace(shape, name=base.model.name, rope=base.model.rope)))
    stack = LayerStack(shape, num_layers=1)
    print(f"shape: hidden {shape.hidden}, heads {shape.num_heads}, ffn {shape.ffn_hidden}, vocab {shape.vocab}; "
          f"coefficients of {spec} (hidden {base.time_model.hidden}) scaled by FLOPs")
    print(f"{'kind':8s} {'tokens':>7s} {'segs':>5s} {'max C':>6s} {'pred ms':>9s} {'meas ms':>9s} {'err':>7s}")
    errs = {}
    for kind, chunks in COMPARE_CHUNKS.items():
        for lengths, contexts in chunks:
            chunk = Chunk(0, kind, [Segment(i, c, c + s) for i, (s, c) in enumerate(zip(lengths, contexts))])
            feats = chunk_features([chunk])[0]
            pred = float(feats @ (profile.fwd.vector() + profile.bwd.vector()))
            stack.set_segments(lengths, contexts)
            n = sum(lengths)
            f, b = time_fwd_bwd(stack, lambda n=n: (torch.randn(n, 1, shape.hidden, requires_grad=True),), repeats)
            errs.setdefault(kind, []).append(pred / (f + b) - 1)
            print(f"{kind:8s} {n:7d} {len(lengths):5d} {max(contexts):6d} {pred:9.2f} {f + b:9.2f} {pred / (f + b) - 1:+7.1%}")
    for n in (512, 2048):
        f, b = time_fwd_bwd(stack.head_loss, lambda n=n: (torch.randn(n, 1, shape.hidden, requires_grad=True),), repeats)
        feats = np.zeros(NUM_FEATURES)
        feats[[F.S, F.CHUNKS]] = n, 1.0  # the head: per token and per chunk
        pred = float(feats @ (profile.head_fwd.vector() + profile.head_bwd.vector()))
        errs.setdefault("head", []).append(pred / (f + b) - 1)
        print(f"{'head':8s} {n:7d} {1:5d} {0:6d} {pred:9.2f} {f + b:9.2f} {pred / (f + b) - 1:+7.1%}")
    for kind, e in errs.items():
        print(f"{kind:8s} mean err {np.mean(e):+.1%}  mean |err| {np.mean(np.abs(e)):.1%}  max |err| {np.max(np.abs(e)):.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="megatron_epp/cost/profiles/test-model_cpu.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden-size", type=int, default=TEST_MODEL.hidden)
    ap.add_argument("--num-attention-heads", type=int, default=TEST_MODEL.num_heads)
    ap.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    ap.add_argument("--vocab-size", type=int, default=TEST_MODEL.vocab)
    ap.add_argument("--overhead-from", default=None,
                    help="profile JSON whose 'overhead' block is kept (default: --out if it exists, else the shipped profile)")
    ap.add_argument("--compare", metavar="PROFILE", default=None,
                    help="profile nothing: compare PROFILE, scaled to this shape, with measured chunks")
    args = ap.parse_args()
    shape = dataclasses.replace(TEST_MODEL, hidden=args.hidden_size, num_heads=args.num_attention_heads, ffn_hidden=args.ffn_hidden_size or 4 * args.hidden_size, vocab=args.vocab_size)
    if shape != TEST_MODEL:
        shape = dataclasses.replace(shape, name=f"{TEST_MODEL.name}-h{shape.hidden}")
    init_single_process()  # one thread before anything is timed
    torch.manual_seed(0)
    if args.compare:
        compare(shape, args.compare, args.repeats)
        return
    overhead_from = Path(args.overhead_from or (args.out if Path(args.out).exists() else PROFILE_DIR / "test-model_cpu.json"))
    overhead = json.loads(overhead_from.read_text()).get("overhead")
    att_f, att_b, errors = profile_attention(shape, args.repeats)
    layer, stack = profile_layer(shape, att_f, att_b, args.repeats)
    head = profile_head(shape, stack, args.repeats)
    memory = derived_memory(shape)
    errors.update({k: v[1] for k, v in {**layer, **head}.items()})
    errors.update(check_memory(shape, stack, memory))
    profile = Profile(
        model=shape,
        device=f"CPU {platform.processor() or platform.machine()} (1 thread, fp32)",
        source="measured",
        tp=1,
        fwd=layer["fwd"][0],
        bwd=layer["bwd"][0],
        recompute=layer["recompute"][0],
        head_fwd=head["head_fwd"][0],
        head_bwd=head["head_bwd"][0],
        memory=memory,
        fit={"errors": errors, "torch": torch.__version__, "note": "measured by scripts/profile_layer.py"},
        overhead=StageOverhead(**overhead) if overhead else StageOverhead(),
    )
    profile.save(args.out)
    print(f"wrote {args.out}")
    for name, e in errors.items():
        print(f"  {name:18s} rms rel err {e['rms_rel_err']*100:6.2f} %   max {e['max_rel_err']*100:6.2f} %   ({e['points']} points)")


if __name__ == "__main__":
    main()
