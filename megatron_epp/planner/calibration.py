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
steps (``--epp-calibrate-interval``) and ``scripts/calibrate_step.py`` offline, by the same function.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import least_squares

from megatron_epp.cost.model import CostModel
from megatron_epp.cost.profiles import StageOverhead
from megatron_epp.plan import Plan
from megatron_epp.planner.epp import predicted_times
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


def repredict(plan: Plan, cost_model: CostModel) -> Plan:
    """``plan`` with its predicted times (``plan.stats``) on ``cost_model``, in place; unchanged if they
    were predicted with the same calibration (speed factor and overhead)."""
    o = cost_model.profile.overhead
    if (plan.stats.speed_factor, plan.stats.stage_overhead_ms) != (cost_model.speed_factor, o.fwd_ms + o.bwd_ms):
        plan.stats = dataclasses.replace(plan.stats, **predicted_times(plan, cost_model, simulate(plan, cost_model)))
    return plan
