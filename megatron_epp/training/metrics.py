"""One metrics record per logged step (``--epp-metrics FILE``, JSON lines): what the log line says, typed.

The logging rank appends each logged step's record, its own numbers, to the file, and prints the line of
:func:`interval_average`: ms/iter, lm loss and tokens/s averaged over the ``--log-interval`` iterations since
the previous log, as Megatron-LM's log line (equal to the record's at ``--log-interval 1``). Calibration, the
benchmarks and the tests read the records (:func:`read_metrics`), never the log text.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal


@dataclass
class ElasticMetrics:
    """An ``--elastic-pp`` step: its plan, the planner's prediction and what was measured."""

    plan: str  # Plan.summary()
    num_chunks: dict[str, int]  # by kind
    num_pipelines: int
    recomputed_layers: int
    planning_ms: float  # the planner's run for this step's batch
    planning_wait_ms: float  # of which the step waited for (0 when planning overlapped the previous step)
    predicted_step_ms: float | None  # on this machine once the cost model is calibrated (speed_factor)
    measured_ms: float  # forward_backward_elastic on this rank: every pipeline of the plan
    # per stage, training steps only: the peak activation bytes the plan was predicted (and planned) with, on the memory
    # model calibrated to this machine's measured peaks (the profile's prediction times memory_factor), and measured
    # (CUDA: the allocator's peak above what the step started with; CPU: the tensors autograd saves)
    predicted_activation_bytes: list[float] | None = None
    measured_activation_bytes: list[int] | None = None
    # the cost model's calibration the prediction used (--epp-calibrate-interval): the speed factor s
    # (1: the machine the profile was taken on) and the per-chunk stage overhead o (profile ms)
    speed_factor: float | None = None
    stage_overhead_ms: float | None = None
    # the planner's time (planning the next step, in a thread on the planning rank's core) inside this step's
    # forward_backward_elastic span on that rank: the time model does not count it
    planning_overlap_ms: float | None = None
    padding_tokens: int = 0  # --sequence-parallel / --context-parallel-size: tokens added to the step's chunks (each to a multiple of tp x cp)
    memory_factor: float | None = None  # the activation memory factor of the prediction (1: the profile's coefficients)
    # CUDA: the allocator's allocated peak per stage where it differs from measured_activation_bytes (its reserved peak)
    measured_allocated_bytes: list[int] | None = None
    model_state_bytes: list[float] | None = None  # per stage, the planner's count (the peak is these + activations)
    memory_budget_bytes: float | None = None  # what the plan was made to fit (model states + activations per device)
    oom_retries: int = 0  # runs of this step's batch that ran out of memory before the one that trained (each planned again)
    # the elastic builder's plan against the baselines it weighed on the same cost model: Megatron packing's and the
    # fastest Seq1F1B's predicted step time over the chosen plan's (> 1: faster), by plan label (planner.builders.baseline_ratios)
    baseline_ratios: dict[str, float] | None = None
    # --context-parallel-size N > 1: the measured peak per stage and context-parallel rank ([stage][cp rank]; the
    # per-stage measured_activation_bytes is the largest of a stage's)
    measured_cp_activation_bytes: list[list[int]] | None = None
    # --epp-offload: the plan's checkpoints in host memory (over its stages and chunks), and per stage a GPU's host bytes
    # the plan was predicted with and the host pool's measured peak (None: the plan offloads nothing)
    offloaded_layers: int = 0
    predicted_host_bytes: list[float] | None = None
    measured_host_bytes: list[int] | None = None

    def scalars(self) -> dict[str, float]:
        """The plan's statistics as named scalars (TensorBoard, wandb)."""
        out = {f"plan/chunks {kind}": float(n) for kind, n in self.num_chunks.items()}
        out.update({"plan/pipelines": float(self.num_pipelines), "plan/recomputed layers": float(self.recomputed_layers),
                    "plan/planning ms": self.planning_ms, "plan/planning exposed ms": self.planning_wait_ms,
                    "plan/measured ms": self.measured_ms, "plan/padding tokens": float(self.padding_tokens)})
        if self.predicted_step_ms is not None:
            out["plan/predicted ms"] = self.predicted_step_ms
        for name, per_stage in (("predicted", self.predicted_activation_bytes), ("measured", self.measured_activation_bytes)):
            for stage, value in enumerate(per_stage or ()):
                out[f"memory/stage {stage} {name} activation MB"] = value / 2**20
        if self.memory_factor is not None:
            out["memory/activation factor"] = self.memory_factor
        if self.predicted_host_bytes is not None:
            out["plan/offloaded checkpoints"] = float(self.offloaded_layers)
            for name, per_stage in (("predicted", self.predicted_host_bytes), ("measured", self.measured_host_bytes)):
                for stage, value in enumerate(per_stage or ()):
                    out[f"memory/stage {stage} {name} host MB"] = value / 2**20
        out["memory/out-of-memory retries"] = float(self.oom_retries)
        for label, ratio in (self.baseline_ratios or {}).items():
            out[f"plan/predicted {label.split('-k')[0]} / plan"] = ratio
        return out

    def line(self) -> str:
        hidden = "hidden" if self.planning_wait_ms < 1.0 else f"exposed {self.planning_wait_ms:.1f} ms"
        text = f"{self.plan} | "
        if self.baseline_ratios:
            text += "baseline/plan predicted: " + ", ".join(f"{label} {r:.2f}x" for label, r in self.baseline_ratios.items()) + " | "
        text += (f"padding: {self.padding_tokens} token{'s' if self.padding_tokens > 1 else ''} | " if self.padding_tokens else "")
        text += f"planning ms: {self.planning_ms:.1f} ({hidden}) | "
        if self.predicted_step_ms is not None:
            text += f"predicted ms: {self.predicted_step_ms:.1f} | "
        text += f"measured ms: {self.measured_ms:.1f}"
        if self.measured_activation_bytes is not None:
            pairs = ", ".join(f"{p / 2**20:.2f}/{m / 2**20:.2f}"
                              for p, m in zip(self.predicted_activation_bytes, self.measured_activation_bytes))
            text += f" | act MB pred/meas per stage: {pairs}"
            if self.measured_allocated_bytes is not None:
                text += " (meas: reserved; allocated " + ", ".join(f"{a / 2**20:.2f}" for a in self.measured_allocated_bytes) + ")"
            if self.memory_factor not in (None, 1.0):  # the raw model's prediction: pred / factor
                text += f" (pred = {self.memory_factor:.3f} x the raw memory model's)"
            if self.measured_cp_activation_bytes is not None:
                text += " | act MB meas per stage and CP rank: " + ", ".join(
                    "/".join(f"{m / 2**20:.2f}" for m in stage) for stage in self.measured_cp_activation_bytes)
        if self.predicted_host_bytes is not None:
            pairs = ", ".join(f"{p / 2**20:.2f}/{'n/a' if m is None else f'{m / 2**20:.2f}'}"
                              for p, m in zip(self.predicted_host_bytes, self.measured_host_bytes or [None] * len(self.predicted_host_bytes)))
            text += f" | host MB pred/meas per stage: {pairs}"
        if self.oom_retries:
            text += f" | out of memory on {self.oom_retries} plan{'s' if self.oom_retries > 1 else ''} of this batch, planned again"
        return text


@dataclass
class StepMetrics:
    """A logged training iteration (``kind="train"``) or a validation pass (``kind="valid"``: only
    ``iteration`` and ``loss``)."""

    iteration: int
    loss: float
    kind: Literal["train", "valid"] = "train"
    train_iters: int | None = None
    consumed_samples: int | None = None
    iter_ms: float | None = None  # the whole iteration: step, optimizer, loss broadcast
    tokens: float | None = None  # in the global batch (interval_average: the mean over its iterations)
    lr: float | None = None
    grad_norm: float | None = None
    elastic: ElasticMetrics | None = None
    tflops_per_gpu: float | None = None  # --log-throughput: model FLOPs of the tokens trained / s / GPU, in 1e12

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.iter_ms / 1000)

    def line(self) -> str:
        """The log line people read."""
        if self.kind == "valid":
            return (f" validation loss at iteration {self.iteration} | lm loss value: {self.loss:.6E} | "
                    f"lm loss PPL: {math.exp(min(self.loss, 20)):.6E}")
        text = (
            f" iteration {self.iteration:8d}/{self.train_iters:8d} | consumed samples: {self.consumed_samples:10d} | "
            f"elapsed time per iteration (ms): {self.iter_ms:.1f} | tokens/s: {self.tokens_per_s:.0f} | "
            + (f"throughput per GPU (TFLOP/s/GPU): {self.tflops_per_gpu:.3f} | " if self.tflops_per_gpu is not None else "")
            + f"learning rate: {self.lr:.6E} | lm loss: {self.loss:.6E} | grad norm: {self.grad_norm:.4f}"
        )
        return text + (f" | {self.elastic.line()}" if self.elastic else "")

    def scalars(self) -> dict[str, float]:
        """What TensorBoard and wandb get, by name."""
        if self.kind == "valid":
            return {"validation lm loss": self.loss}
        out = {"lm loss": self.loss, "learning-rate": self.lr, "grad-norm": self.grad_norm, "tokens/s": self.tokens_per_s,
               "iteration-time ms": self.iter_ms}
        if self.tflops_per_gpu is not None:
            out["throughput TFLOP/s/GPU"] = self.tflops_per_gpu
        return out | (self.elastic.scalars() if self.elastic else {})

    def to_json(self) -> str:
        return json.dumps({"tokens_per_s": self.tokens_per_s if self.kind == "train" else None, **asdict(self)})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepMetrics":
        d = {k: v for k, v in d.items() if k != "tokens_per_s"}  # derived
        elastic = d.pop("elastic", None)
        return cls(**d, elastic=ElasticMetrics(**elastic) if elastic else None)

    @classmethod
    def from_json(cls, text: str) -> "StepMetrics":
        return cls.from_dict(json.loads(text))


def interval_average(logged: StepMetrics, interval: list[StepMetrics]) -> StepMetrics:
    """``logged`` (a logged training iteration's record) as Megatron-LM's log line shows it: elapsed ms per
    iteration, lm loss, tokens/s (and TFLOP/s/GPU) over ``interval``, the iterations since the previous log
    (``logged``'s included); learning rate, grad norm and the plan stay the logged iteration's."""
    if len(interval) == 1:  # --log-interval 1: the record's own line, to the last digit
        return logged
    n, ms = len(interval), sum(r.iter_ms for r in interval)
    return replace(
        logged, iter_ms=ms / n, loss=sum(r.loss for r in interval) / n, tokens=sum(r.tokens for r in interval) / n,
        tflops_per_gpu=None if logged.tflops_per_gpu is None else sum(r.tflops_per_gpu * r.iter_ms for r in interval) / ms,
    )


def read_metrics(path: str | Path) -> list[StepMetrics]:
    """The records of a ``--epp-metrics`` file, in order."""
    return [StepMetrics.from_json(line) for line in Path(path).read_text().splitlines() if line.strip()]
