"""The cost model calibrated on measured steps: the machine's speed factor ``s`` and the executor's
per-chunk stage overhead ``o``.

The layer profile predicts the layers' time on the machine it was taken on; a real step on this
machine takes ``s`` times that (another CPU, other jobs on the cores, another GPU clock), and the
executor adds per chunk and stage its own time outside the layers (megatron-core's
``forward_step``/``backward_step``, the chunk's layout, the point-to-point calls, autograd hooks),
``o`` in the profile's ms (so ``s x o`` on this machine). The model of a measured step is

    measured = s x simulated(plan; overhead o)

(the simulator's step on the cost model with ``o`` split ``fwd_share`` / ``1 - fwd_share`` between
each chunk's forward and backward on every stage). :func:`fit_step_model` fits both by bounded,
robust least squares on relative residuals; the training driver refits them online from its own
steps (``--epp-calibrate-interval``) and ``benchmarks/calibrate_step.py`` offline, by the same function.

Memory: the profile's activation coefficients times one factor ``f`` (:func:`with_memory_factor`), fitted
on the measured per-stage activation peaks (on CUDA the allocator's) as the largest measured /
predicted ratio seen, at least 1 (:func:`fit_memory_factor`); :class:`MemoryCheck` holds one step's
peaks against the budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import least_squares

from megatron_epp.cost.features import chunk_features
from megatron_epp.cost.model import CostModel
from megatron_epp.base.units import GIB
from megatron_epp.cost.profile import MemoryCoeffs, StageOverhead
from megatron_epp.plan import Plan, PlannedStep
from megatron_epp.planner.stats import PredictedTimes
from megatron_epp.simulator.memory import peak_memory
from megatron_epp.simulator.step import simulate, step_ms

# Bounds of the speed factor: far outside any machine pairing seen (0.4-2.5 on CPUs), only there to
# keep the solver finite when the steps carry no information about it.
SPEED_FACTOR_BOUNDS = (0.02, 50.0)
# Relative error at which the loss turns from quadratic to linear (soft L1): a step slowed by another
# job on the machine pulls the fit as a 5 % error would, not as its square.
ROBUST_SCALE = 0.05
# The training driver's pull toward the overhead it starts from (``prior_weight``): the few steps of one
# run rarely vary their chunk counts enough to tell ``o`` from ``s``.
ONLINE_PRIOR_WEIGHT = 0.1


@dataclass(frozen=True)
class StepFit:
    """Fitted ``s`` and ``o`` (per chunk and stage, forward + backward, profile ms), and the relative
    errors (predicted / measured - 1) of the steps fitted on, before (the cost model as given) and after."""

    speed_factor: float
    overhead_ms: float
    fwd_share: float
    rel_err_before: np.ndarray
    rel_err_after: np.ndarray

    @property
    def fwd_ms(self) -> float:
        return self.overhead_ms * self.fwd_share

    @property
    def bwd_ms(self) -> float:
        return self.overhead_ms * (1 - self.fwd_share)

    def apply(self, cost_model: CostModel) -> CostModel:
        """``cost_model`` with this speed factor and overhead."""
        return cost_model.calibrated(self.speed_factor, StageOverhead(self.fwd_ms, self.bwd_ms))


def simulate_steps(plans: Sequence[Plan], cost_model: CostModel) -> np.ndarray:
    """The simulated step ms of each plan on ``cost_model``."""
    return np.array([step_ms(p, cost_model) for p in plans])


def fit_step_model(plans: Sequence[Plan], measured_ms: Sequence[float], cost_model: CostModel, *,
                   fwd_share: float | None = None, fit_speed: bool = True, prior_weight: float = 0.0) -> StepFit:
    """Fit ``s`` and ``o`` so that ``s x simulated(plan; o)`` matches ``measured_ms``, starting from
    ``cost_model``'s own values.

    Least squares of relative residuals under a soft-L1 loss (:data:`ROBUST_SCALE`), over ``s`` and
    the overhead on this machine ``u = s x o``. Every time in the simulator scales with ``s``, so a
    step is ``s x g(o)`` with ``g`` the step at ``s = 1``: close to linear in ``(s, u)`` (layer time
    x ``s`` + overheads on the critical path x ``u``, up to the critical path changing), and its
    derivatives need one more simulation of every plan, at ``o + delta``. Bounds: ``s`` in
    :data:`SPEED_FACTOR_BOUNDS`; ``0 <= u <= min(step / chunks)``, since stage 0 runs every chunk's
    forward and backward.

    ``fwd_share``: the part of ``o`` put on the forward (default: ``cost_model``'s split, or half when
    it has none). ``fit_speed=False`` keeps ``cost_model``'s speed factor and fits ``o`` alone.
    ``prior_weight`` ``w`` > 0 adds the residual ``w x (o / o_now - 1)`` toward ``cost_model``'s own
    overhead ``o_now`` (when it has one): steps whose plans all have about the same number of chunks
    cannot tell ``o`` from ``s`` (any split fits them), and the planner chooses its chunks by ``o``;
    with ``w = 0.1`` (:data:`ONLINE_PRIOR_WEIGHT`) a 50 % change of ``o`` weighs as a 5 % step error.
    """
    y = np.asarray(measured_ms, dtype=float)
    if len(y) != len(plans) or len(y) == 0:
        raise ValueError(f"calibration needs one measured time per plan: {len(plans)} plans, {len(y)} times")
    if not (np.isfinite(y).all() and (y > 0).all()):
        raise ValueError(f"measured step times must be positive and finite: {y.tolist()}")
    now = cost_model.profile.overhead
    o_now = now.fwd_ms + now.bwd_ms
    share = fwd_share if fwd_share is not None else (now.fwd_ms / o_now if o_now > 0 else 0.5)
    chunks = np.array([sum(len(p.chunks) for p in plan.pipelines) for plan in plans], dtype=float)
    u_max = float(np.min(y / chunks))
    s_now = float(np.clip(cost_model.speed_factor, *SPEED_FACTOR_BOUNDS))
    w = prior_weight if o_now > 0 else 0.0
    steps: dict[float, np.ndarray] = {}

    def g(o: float) -> np.ndarray:
        """Every plan's step at s = 1 with overhead ``o``."""
        if o not in steps:
            steps[o] = simulate_steps(plans, cost_model.calibrated(1.0, StageOverhead(o * share, o * (1 - share))))
        return steps[o]

    def unpack(x: np.ndarray) -> tuple[float, float]:
        return (float(x[0]), float(x[1])) if fit_speed else (s_now, float(x[0]))

    def residuals(x: np.ndarray) -> np.ndarray:
        s, u = unpack(x)
        return np.append(s * g(u / s) / y - 1, w * (u / (s * o_now) - 1) if w else [])

    def jacobian(x: np.ndarray) -> np.ndarray:
        s, u = unpack(x)
        o, delta = u / s, 1e-6 * u_max / s
        slope = (g(o + delta) - g(o)) / delta  # overheads on the critical path
        d_s, d_u = (g(o) - o * slope) / y, slope / y
        if w:
            d_s, d_u = np.append(d_s, -w * u / (s * s * o_now)), np.append(d_u, w / (s * o_now))
        return np.stack([d_s, d_u], axis=1) if fit_speed else d_u[:, None]

    # start inside the bounds: the solver's first trust region is as large as the start is far from 0
    u0 = float(np.clip(s_now * o_now, 0.05 * u_max, 0.95 * u_max))
    if fit_speed:
        x0, lo, hi = [s_now, u0], [SPEED_FACTOR_BOUNDS[0], 0.0], [SPEED_FACTOR_BOUNDS[1], u_max]
    else:
        x0, lo, hi = [u0], [0.0], [u_max]
    s, u = unpack(least_squares(residuals, x0, jac=jacobian, bounds=(lo, hi), loss="soft_l1", f_scale=ROBUST_SCALE, x_scale="jac").x)
    return StepFit(s, u / s, share, simulate_steps(plans, cost_model) / y - 1, s * g(u / s) / y - 1)


def repredict(step: PlannedStep, cost_model: CostModel) -> PlannedStep:
    """``step`` with its report's predicted times on ``cost_model`` (a new report); ``step`` itself if they were
    predicted with the same calibration (speed factor and overhead)."""
    o, report = cost_model.profile.overhead, step.report
    if (report.speed_factor, report.stage_overhead_ms) == (cost_model.speed_factor, o.fwd_ms + o.bwd_ms):
        return step
    times = PredictedTimes.of(step.plan, cost_model, simulate(step.plan, cost_model))
    return dataclasses.replace(step, report=times.onto(report))


# ----------------------------------------------------------------------------- activation memory
# The memory model calibrated on the allocator: one factor ``f`` on every activation coefficient of the
# profile (what layers, the head and the embedding keep for backward, checkpoints, K/V buffers; the
# workspace and K/V gradient accumulators follow, as multiples of them), so that a plan's predicted
# activation peak on a stage is ``f`` x the raw model's (the walk is linear in the coefficients). Model
# states are counted as the profile counts them and never scaled.
ACTIVATION_COEFFS = ("act_token", "act_area", "act_context", "act_slice", "lone_slice_token", "ckpt_token", "kv_token",
                     "logits_token", "embed_token", "recompute_input_token")


def with_memory_factor(cost_model: CostModel, raw: MemoryCoeffs, factor: float) -> CostModel:
    """``cost_model`` (its speed factor and overhead kept) with the activation coefficients ``factor`` x ``raw``'s
    (the profile's, derived for the model shape): coefficients as given (no ``derive``), so that later
    :meth:`CostModel.calibrated` calls keep them."""
    memory = dataclasses.replace(raw, derive="", **{k: getattr(raw, k) * factor for k in ACTIVATION_COEFFS})
    return CostModel(dataclasses.replace(cost_model.profile, memory=memory), cost_model.num_stages, cost_model.layers,
                     cost_model.dp, cost_model.network, cost_model.speed_factor, cost_model.host)


def activation_bytes(plan: Plan, cost_model: CostModel) -> np.ndarray:
    """Per-stage peak activation bytes of ``plan`` (model states excluded) by the planner's exact memory walk."""
    no_states = np.zeros(plan.num_stages)
    return np.max([peak_memory(p, cost_model.costs(chunk_features(p.chunks)), cost_model.layers, no_states)
                   for p in plan.pipelines], axis=0)


def fit_memory_factor(ratios: Sequence[float]) -> float:
    """The activation memory factor that keeps every observed step's measured peak within its prediction:
    the largest measured / raw-predicted ratio seen, never below 1.

    The largest, not a quantile: the budget is a bound (past it a GPU runs out of memory, it does not slow
    down), and within a run the ratio is a property of the layer's kernels and the builder's plans that moves
    little (the H100 evidence, ``tests/data/h100_activation_peaks.json``: 1.30-1.37 over one run's steps,
    1.22-1.23 over another's; no step more than 2.3 % above the largest ratio of the steps before it), so the
    largest costs a few per cent of activation memory where a quantile would leave steps above the budget by
    construction. Never below 1: where the raw model over-predicts (3 of the 13 runs: 0.87-0.99 of the
    prediction measured), the same model and profile under-predict another builder's plans (the llama-like
    layer at 32K: Megatron packing 0.94, EPP 1.28-1.32; the h1024 layer: EPP under a 4 GB budget 0.93-0.99,
    Seq1F1B 1.08-1.13), so a factor below 1 learned on one plan would put a later, different one over the budget; and where the measurement is the model's own count (CPU: the saved
    tensors), the ratio is 1 and nothing changes."""
    return max(1.0, *map(float, ratios)) if len(ratios) else 1.0


@dataclass(frozen=True)
class MemoryCheck:
    """One training step's measured per-stage activation peaks beside its plan's raw prediction (the
    profile's coefficients), and the peaks with model states (as the cost model counts them) against the
    budget (bytes)."""

    step: int
    raw_predicted: np.ndarray
    measured: np.ndarray
    states: np.ndarray
    budget: float

    @property
    def ratio(self) -> float:
        """The largest measured / raw-predicted activation peak over the stages."""
        raw = np.asarray(self.raw_predicted, dtype=float)
        return float(np.max(np.divide(self.measured, raw, out=np.ones_like(raw), where=raw > 0)))

    @property
    def peaks(self) -> np.ndarray:
        return np.asarray(self.states, dtype=float) + np.asarray(self.measured, dtype=float)

    @property
    def over(self) -> bool:
        return bool((self.peaks > self.budget * (1 + 1e-9)).any())

    def overshoot_line(self) -> str:
        """`` memory: step 7 stage 1 peak 15.4 GB > budget 12.0 GB (+28 %)``: the stage most over the budget."""
        stage = int(np.argmax(self.peaks))
        peak = self.peaks[stage]
        return (f" memory: step {self.step} stage {stage} peak {peak / GIB:.1f} GB > budget {self.budget / GIB:.1f} GB "
                f"(+{100 * (peak / self.budget - 1):.0f} %; model states {self.states[stage] / GIB:.1f} GB + activations "
                f"{self.measured[stage] / GIB:.1f} GB measured, {self.raw_predicted[stage] / GIB:.1f} GB by the raw memory model)")
