"""Profile Megatron-Core's transformer layer on this machine and fit the planner's cost model.

Measures, with one thread:
  * ``scaled_dot_product_attention`` of ``s`` queries over ``C + s`` keys (prefix K/V concatenated,
    bottom-right causal boolean mask), forward and backward, over an ``(s, C)`` grid: fits the
    attention coefficients ``a1`` (s^2), ``a1c`` (s*C), ``ac`` (C) and the per-segment constant;
  * the full ``TransformerLayer`` (local spec, this attention) at ``C = 0`` over lengths: fits the
    linear term ``a2`` and the constant ``b1`` after removing the attention's quadratic part;
    recompute = (forward+backward with ``torch.utils.checkpoint``) - (forward+backward), fitted as
    a ratio of the forward;
  * the output head (linear + cross entropy) forward/backward;
  * the bytes autograd saves per layer (activation memory per token, per attention area, per prefix
    token) and for the head (logits per token).

Writes the profile JSON and prints every fit's error.

    python scripts/profile_layer.py --out megatron_epp/planner/profiles/test-model_cpu.json
"""

from __future__ import annotations

import argparse
import platform

import numpy as np
import torch
from scipy.optimize import nnls

from megatron_epp.model.chunk_state import bottom_right_causal_mask
from megatron_epp.model.elastic_attention import segment_attention
from megatron_epp.planner.layer_bench import LayerStack, init_single_process, saved_bytes, time_fwd_bwd
from megatron_epp.planner.profiles import TEST_MODEL, MemoryCoeffs, ModelShape, Profile, TimeCoeffs


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
    out["recompute"] = (TimeCoeffs(*(fc.vector() * ratio + np.eye(6)[5] * extra)), {**err, "ratio_to_fwd": ratio})
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


def profile_memory(shape: ModelShape, stack: LayerStack) -> tuple[dict[str, float], dict]:
    rows, y = [], []
    for s, c in [(128, 0), (256, 0), (512, 0), (1024, 0), (2048, 0), (256, 512), (256, 2048), (512, 1024), (1024, 2048)]:
        stack.set_segments([s], [c])
        x = torch.randn(s, 1, shape.hidden, requires_grad=True)
        rows.append([s, s * (c + s), c])
        y.append(saved_bytes(lambda: stack(x)))
    X, y = np.array(rows, dtype=float), np.array(y, dtype=float)
    (tok, area, ctx), err = fit(X, y)
    logits = saved_bytes(lambda: stack.head_loss(torch.randn(1024, 1, shape.hidden, requires_grad=True))) / 1024
    return {"act_token": tok, "act_area": area, "act_context": ctx, "logits_token": logits}, {"activation_bytes": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="megatron_epp/planner/profiles/test-model_cpu.json")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    shape = TEST_MODEL
    init_single_process()  # one thread before anything is timed
    torch.manual_seed(0)
    att_f, att_b, errors = profile_attention(shape, args.repeats)
    layer, stack = profile_layer(shape, att_f, att_b, args.repeats)
    head = profile_head(shape, stack, args.repeats)
    mem, mem_err = profile_memory(shape, stack)
    errors.update({k: v[1] for k, v in {**layer, **head}.items()})
    errors.update(mem_err)
    h = shape.hidden
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
        memory=MemoryCoeffs(
            act_token=mem["act_token"],
            act_area=mem["act_area"],
            act_context=mem["act_context"],
            ckpt_token=4.0 * h,
            kv_token=2 * 4.0 * shape.kv_hidden,
            logits_token=mem["logits_token"],
            weight=4.0,
            grad=4.0,
            optim=8.0,
            distributed_optimizer=False,
            p2p_token=4.0 * h,
        ),
        fit={"errors": errors, "torch": torch.__version__, "note": "measured by scripts/profile_layer.py"},
    )
    profile.save(args.out)
    print(f"wrote {args.out}")
    for name, e in errors.items():
        print(f"  {name:18s} rms rel err {e['rms_rel_err']*100:6.2f} %   max {e['max_rel_err']*100:6.2f} %   ({e['points']} points)")


if __name__ == "__main__":
    main()
