"""Fitting a measured profile's time coefficients to timings (numpy; the timings come from
``megatron_epp.measure.profiling`` on a GPU, or ``benchmarks/profile_layer.py`` on the CPU).

Every fit is non-negative least squares of the *relative* error (:func:`fit`), and reports its error
(:func:`rel_errors`: rms and max relative error over its points), which the profile stores in
``fit["errors"]``. The GPU profiler's structure (:func:`attention_fit`, :func:`layer_fit`, :func:`head_fit`):

* the attention kernel alone over an ``(s, C)`` grid gives the per-pair terms ``a1`` (``s^2``), ``a1c``
  (``s C``), ``ac`` (``C``) and the per-segment constant ``bs``;
* one layer over ``lengths`` at ``C = 0``, less the attention's ``a1 s^2 + bs``, gives ``a2`` and ``b1``;
* the recompute (the time a checkpointed layer adds to forward + backward) is fitted on its own
  per-token and per-chunk terms, plus the forward's attention part scaled by one factor
  (:func:`recompute_fit`); see there for why it is not a ratio of the forward;
* the per-chunk constant ``b1`` of the layer and the head, where the profiler measured it directly (the same tokens
  as one chunk and as several: :func:`with_chunk_cost`), is that measurement, and ``a2`` is refitted beside it.

Memory (:func:`measured_memory`): the bytes a layer keeps for its backward, plain and checkpointed, and the
output head's, measured at each length (a GPU's caching allocator, or on the CPU the tensors autograd saves), are
fitted per token by least squares (:func:`per_token_fit`); on a GPU the peak during forward + backward above the
start gives the backward's workspace.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np
from scipy.optimize import nnls

from megatron_epp.cost.features import NUM_FEATURES, F
from megatron_epp.cost.activation_memory import MEASURED_MEMORY, derived_memory
from megatron_epp.cost.profile import MemoryCoeffs, Profile, StageOverhead, TimeCoeffs, megatron_model_state
from megatron_epp.cost.shape import DTYPE_BYTES, ModelShape

Fitted = tuple[TimeCoeffs, dict[str, Any]]  # coefficients and their fit's errors


def rel_errors(pred: np.ndarray, meas: np.ndarray) -> dict[str, float]:
    """rms and max relative error of ``pred`` against ``meas``, and the number of points."""
    rel = np.asarray(pred, dtype=float) / np.asarray(meas, dtype=float) - 1.0
    return {"rms_rel_err": float(np.sqrt(np.mean(rel**2))), "max_rel_err": float(np.max(np.abs(rel))), "points": len(rel)}


def fit(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """Non-negative least squares on relative error; returns coefficients and error stats."""
    A = X / y[:, None]
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(A / scale, np.ones_like(y))[0] / scale
    return coef, rel_errors(X @ coef, y)


def attention_fit(points: Sequence[tuple[int, int]], fwd_ms: Sequence[float], bwd_ms: Sequence[float]) -> dict[str, tuple[np.ndarray, dict]]:
    """``[a1, a1c, a_lin, ac, bs]`` of the attention kernel's forward and backward from its timings at
    ``points`` = ``(s, C)`` (the linear term is the layer's business: :func:`layer_fit` refits it)."""
    X = np.array([[s * s, s * c, s, c, 1.0] for s, c in points], dtype=float)
    return {name: fit(X, np.asarray(t, dtype=float)) for name, t in (("attention_fwd", fwd_ms), ("attention_bwd", bwd_ms))}


def recompute_fit(lengths: np.ndarray, recompute_ms: np.ndarray, fwd: TimeCoeffs) -> Fitted:
    """The recompute coefficients from the time a checkpointed layer adds at ``C = 0`` (one segment of
    each length): ``r (a1 s^2 + bs) + a2' s + b1'`` with the forward's attention coefficients scaled by one
    factor ``r`` (a recompute re-runs the forward's attention) and its own per-token and per-chunk terms.

    The ratio-of-the-forward model (``r x forward + constant``) it replaces fitted the H100 h1024 timings
    with 27 % rms error: on a GPU a small layer's forward is launch-bound (its per-chunk constant, 1.8 ms,
    is most of it), and a recompute re-launches the forward's kernels under the backward's, which hides
    part of that constant, so the recompute is not a multiple of the forward; its per-token term is
    the forward's GEMMs once more (no saving)."""
    n = np.asarray(lengths, dtype=float)
    quad = fwd.a1 * n**2 + fwd.bs
    X = np.stack([quad, n, np.ones_like(n)], 1)
    (r, a2, b1), err = fit(X, np.asarray(recompute_ms, dtype=float))
    coeffs = TimeCoeffs(fwd.a1 * r, fwd.a1c * r, a2, fwd.ac * r, fwd.bs * r, b1)
    return coeffs, {**err, "attention_ratio_to_fwd": float(r)}


def layer_fit(lengths: Sequence[int], fwd_ms: Sequence[float], bwd_ms: Sequence[float], recompute_ms: Sequence[float],
              att_fwd: np.ndarray, att_bwd: np.ndarray) -> dict[str, Fitted]:
    """The layer's forward, backward and recompute coefficients from its timings on one segment of each of
    ``lengths`` (``C = 0``): ``a2``/``b1`` beside the attention's ``a1 s^2 + bs`` (``att_*`` from
    :func:`attention_fit`), its ``a1``, ``a1c``, ``ac``, ``bs`` as the attention fitted them."""
    n = np.asarray(lengths, dtype=float)
    X = np.stack([n, np.ones_like(n)], 1)
    out: dict[str, Fitted] = {}
    for name, t, att in (("fwd", np.asarray(fwd_ms, dtype=float), att_fwd), ("bwd", np.asarray(bwd_ms, dtype=float), att_bwd)):
        quad = att[0] * n**2 + att[4]  # the attention's s^2 term and per-segment constant
        (a2, b1), _ = fit(X, np.maximum(t - quad, 1e-6))
        out[name] = (TimeCoeffs(att[0], att[1], a2, att[3], att[4], b1), rel_errors(quad + a2 * n + b1, t))
    out["recompute"] = recompute_fit(n, np.asarray(recompute_ms, dtype=float), out["fwd"][0])
    return out


def with_chunk_cost(fitted: dict[str, Fitted], lengths: Sequence[int], times: Mapping[str, Sequence[float]],
                    chunk_ms: Mapping[str, float]) -> dict[str, Fitted]:
    """``fitted`` (:func:`layer_fit`'s or :func:`head_fit`'s terms) with each of ``chunk_ms``'s terms' per-chunk constant
    ``b1`` set to the measured one and its ``a2`` refitted by least squares beside it (non-negative), on its timings
    ``times[name]`` at ``lengths`` (one segment, ``C = 0``); the errors are those of the new coefficients, with the
    fitted intercept kept as ``b1_fitted``.

    The intercept of a line through a few lengths is not the per-chunk constant on a GPU: a small chunk's GEMMs run
    further from peak, which the intercept mixes in (a negative or tiny one), while the launches and host work that
    one more chunk of the same tokens costs are only seen by cutting the same tokens into more chunks. That split is
    the planner's choice, so its measured cost is what ``b1`` charges."""
    n = np.asarray(lengths, dtype=float)
    out = dict(fitted)
    for name, b1 in chunk_ms.items():
        coeffs, errors = fitted[name]
        t = np.asarray(times[name], dtype=float)
        rest = coeffs.a1 * n**2 + coeffs.bs  # the attention's s^2 term and per-segment constant (0 for the head)
        a2 = max(float(np.dot(n, t - rest - b1) / np.dot(n, n)), 0.0)
        out[name] = (replace(coeffs, a2=a2, b1=float(b1)), {**rel_errors(rest + a2 * n + b1, t), "b1_fitted": coeffs.b1})
    return out


def head_fit(lengths: Sequence[int], fwd_ms: Sequence[float], bwd_ms: Sequence[float]) -> dict[str, Fitted]:
    """The output head's per-token and per-chunk terms, forward and backward."""
    n = np.asarray(lengths, dtype=float)
    X = np.zeros((len(n), NUM_FEATURES))
    X[:, F.S], X[:, F.CHUNKS] = n, 1.0
    out = {}
    for name, t in (("head_fwd", fwd_ms), ("head_bwd", bwd_ms)):
        coef, err = fit(X, np.asarray(t, dtype=float))
        out[name] = (TimeCoeffs(*coef), err)
    return out


def measured_profile(shape: ModelShape, device: str, layer: dict, head: dict, memory: MemoryCoeffs, fit_info: dict,
                     overhead: StageOverhead | None = None) -> Profile:
    """The profile from fitted ``layer``/``head`` terms (``{name: (TimeCoeffs, errors)}``), shared by the CPU
    profiler (``benchmarks/profile_layer.py``) and the GPU one (:mod:`megatron_epp.measure.profiling`)."""
    return Profile(
        model=shape, device=device, source="measured", tp=1,
        fwd=layer["fwd"][0], bwd=layer["bwd"][0], recompute=layer["recompute"][0],
        head_fwd=head["head_fwd"][0], head_bwd=head["head_bwd"][0],
        memory=memory, fit=fit_info, overhead=overhead or StageOverhead(),
    )


MEMORY_DECIMALS = 3  # measured bytes per token are stored rounded to a thousandth of a byte


def per_token_fit(lengths: Sequence[int], nbytes: Sequence[float]) -> tuple[float, dict[str, float]]:
    """Bytes per token of a memory measured at ``lengths`` tokens: the slope of the least-squares line through
    the points (numpy), rounded to :data:`MEMORY_DECIMALS`; its intercept (the allocator's block rounding, a loss
    scalar: nothing per token) and the line's relative errors go to the fit's record."""
    n, y = np.asarray(lengths, dtype=float), np.asarray(nbytes, dtype=float)
    (slope, intercept), *_ = np.linalg.lstsq(np.stack([n, np.ones_like(n)], 1), y, rcond=None)
    slope = round(float(slope), MEMORY_DECIMALS)
    return slope, {**rel_errors(slope * n + intercept, np.maximum(y, 1.0)), "intercept_bytes": float(intercept)}


def memory_basis(device_type: str, dtype: str) -> str:
    """The analytic count a measured memory block is completed and carried by: on the CPU what autograd saves
    (``saved-tensors``, which the CPU measurement equals); on a GPU Megatron's count (``megatron-gpu``, bf16/fp16),
    or ``saved-tensors`` in fp32, which Megatron's count does not cover."""
    return "saved-tensors" if device_type == "cpu" or dtype == "float32" else "megatron-gpu"


def measured_memory(shape: ModelShape, device_type: str, layer: dict[str, Sequence], head: dict[str, Sequence]) -> tuple[MemoryCoeffs, dict]:
    """The memory block of a profile measured on ``device_type`` at ``shape`` (TP 1), and its fits' record.

    ``layer``: ``lengths``, ``kept`` (bytes one layer keeps for its backward after its forward), ``peak`` (the most
    above the start during forward + backward; None where not measured: CPU), ``ckpt_kept`` (the same for the
    checkpointed layer); ``head``: ``lengths``, ``kept``. Fitted per token: ``act_token``, ``ckpt_token``,
    ``logits_token``; where the peak is measured (a GPU's allocator) ``bwd_workspace`` is its excess over the
    kept bytes in layers of activations, and ``kv_grad`` 1 (the allocator holds the K/V gradient accumulators);
    on the CPU both are 0, as the saved tensors count them. The rest (K/V buffers, lone slices, the embedding, a
    recompute's input copy) is the basis count's (:func:`memory_basis`); model states as training keeps them."""
    fits: dict[str, dict] = {}
    measured = {}
    for name, lengths, nbytes in (("act_token", layer["lengths"], layer["kept"]), ("ckpt_token", layer["lengths"], layer["ckpt_kept"]),
                                  ("logits_token", head["lengths"], head["kept"])):
        measured[name], fits[name] = per_token_fit(lengths, nbytes)
    allocator = {"bwd_workspace": 0.0, "kv_grad": 0.0}
    if layer.get("peak") is not None and None not in layer["peak"]:
        peak, fits["peak_token"] = per_token_fit(layer["lengths"], layer["peak"])
        allocator = {"bwd_workspace": round(max(peak - measured["act_token"], 0.0) / measured["act_token"], MEMORY_DECIMALS), "kv_grad": 1.0}
    basis = memory_basis(device_type, shape.dtype)
    memory = MemoryCoeffs(
        **{**derived_memory(basis, shape, 1), **measured, **allocator}, **megatron_model_state(shape.dtype, False),
        p2p_token=float(DTYPE_BYTES[shape.dtype] * shape.hidden), derive=MEASURED_MEMORY, basis=basis,
    )
    return memory, {"fits": fits, "layer": {k: list(v) for k, v in layer.items() if v is not None},
                    "head": {k: list(v) for k, v in head.items() if v is not None}}

