"""The planner's settings, one name each: :class:`PlannerConfig`, made from its ``--epp-*`` options
(:class:`PlannerOptions`), shared by ``epp-plan`` and ``pretrain_gpt.py --elastic-pp``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_epp.base.option_tags import ELASTIC_ONLY, REFUSED_BY_SEARCH, SEARCH_MODELS_THE_PRESET
from megatron_epp.base.options import option
from megatron_epp.cost.clusters import CLUSTERS
from megatron_epp.cost.shape import ModelShape
from megatron_epp.base.units import GIB
from megatron_epp.planner.builders import BUILDERS, ELASTIC, Builder
from megatron_epp.planner.recompute import OFFLOAD_MODES, RECOMPUTE_MODES, Offload, Recompute

DEFAULT_CLUSTER = "h100-ib-gpu"  # --epp-search-layout's cluster preset
# --epp-calibrate-interval: the first fit after this step (the first step is warm-up: lazy initialisation,
# first-touch allocations), on the steps after the warm-up; then every --epp-calibrate-interval steps
CALIBRATE_FIRST_STEP = 5


@dataclass(frozen=True)
class PlannerConfig:
    """What a plan builder needs besides the lengths and the cost model.

    ``builder``: :data:`~megatron_epp.planner.builders.ELASTIC` (EPP), ``MEGATRON`` (packing only) or ``SEQ1F1B``
    (fixed slices), a record of :data:`~megatron_epp.planner.builders.BUILDERS` (``--epp-plan`` names it);
    ``memory_budget_bytes``: per device (``--epp-memory-budget``, given in GB); ``profile``: the cost-model profile (a preset or a JSON path);
    ``recompute``: ``adaptive`` (the per-(stage, chunk) integer program), ``greedy`` (its greedy
    heuristic), ``none`` or ``full``; ``max_slices``: most slices per sequence (seq1f1b: its ``k``),
    None for the planner's defaults; ``time_limit``: the recompute program's wall-clock safety limit,
    seconds per 10,000 nonzeros (at least this; a deterministic node limit bounds the solve first);
    ``max_seq_len``: the context length (megatron's micro-batch tokens); ``offload``: ``none`` (default), ``checkpoints``
    or ``auto`` (checkpoints, and split sequences' K/V buffers where the device cannot hold them) go to host memory
    (docs/planner.md, "Activation offload"); ``host_memory_budget_bytes``: per GPU (``--epp-host-memory-budget``, in
    GB; None: :data:`~megatron_epp.cost.host.HOST_MEMORY_SHARE` of the node's host memory over its GPUs).
    """

    memory_budget_bytes: float
    max_seq_len: int
    profile: str = "auto"
    builder: Builder = ELASTIC
    recompute: Recompute = "adaptive"
    max_slices: int | None = None
    time_limit: float = 1.0
    offload: Offload = "none"
    host_memory_budget_bytes: float | None = None

    def __post_init__(self) -> None:
        if self.builder not in BUILDERS.values():
            raise ValueError(f"--epp-plan {self.builder!r}: one of {', '.join(BUILDERS)}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"--epp-recompute {self.recompute!r}: one of {', '.join(RECOMPUTE_MODES)}")
        if self.memory_budget_bytes <= 0:
            raise ValueError("--epp-memory-budget must be positive")
        if self.max_slices is not None and self.max_slices < 1:
            raise ValueError("--epp-max-slices must be >= 1")
        if self.time_limit <= 0:
            raise ValueError("--epp-time-limit must be positive")
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"--epp-offload {self.offload!r}: one of {', '.join(OFFLOAD_MODES)}")
        if self.host_memory_budget_bytes is not None and self.host_memory_budget_bytes < 0:
            raise ValueError("--epp-host-memory-budget must be >= 0")
        if self.host_memory_budget_bytes is not None and self.offload == "none":
            raise ValueError("--epp-host-memory-budget applies only with --epp-offload checkpoints or auto")

    @classmethod
    def from_options(cls, options: "PlannerOptions", max_seq_len: int, memory_budget_bytes: float | None = None) -> "PlannerConfig":
        """From the ``--epp-*`` options (defaults filled in); the budget ``memory_budget_bytes`` where it was not given
        (``--epp-memory-budget`` is in GB)."""
        budget = options.memory_budget * GIB if memory_budget_bytes is None else memory_budget_bytes
        host = None if options.host_memory_budget is None else options.host_memory_budget * GIB
        return cls(memory_budget_bytes=budget, max_seq_len=max_seq_len, profile=options.profile, builder=BUILDERS[options.plan],
                   recompute=options.recompute, max_slices=options.max_slices, time_limit=options.time_limit,
                   offload=options.offload or "none", host_memory_budget_bytes=host)


@dataclass(frozen=True)
class ShapeOptions:
    """The options that change what a model's layers and output head keep for backward, and so the planner's cost
    model: ``pretrain_gpt.py`` builds the model with them, ``epp-plan`` applies them to its profile's shape
    (:meth:`apply`); the same flags on both."""

    loss_chunk_tokens: int = option("--epp-loss-chunk-tokens", at_least=0, default=0, type=int, metavar="N",
        help="the output head's output layer and cross entropy computed together in blocks of N tokens, the logits of "
             "a block recomputed in backward (a chunked linear cross entropy in plain torch, vocab-parallel at TP > 1): "
             "the head keeps its input, the targets and a log-sum-exp per token, never a chunk's [tokens, vocabulary] "
             "logits; the planner's memory model and the start-up profile count it so. Same weights, the loss equal "
             "within fp32 rounding; overrides a fused cross entropy (--cross-entropy-loss-fusion). 0: off, the whole "
             "chunk's logits (default 0)")
    mlp_chunk_tokens: int = option("--epp-mlp-chunk-tokens", at_least=0, default=0, type=int, metavar="N",
        help="every layer's MLP computed in blocks of N of a rank's tokens (its sequence-parallel shard under sequence "
             "parallelism), each block's MLP recomputed in backward (a sequence-tiled MLP in plain torch): a layer keeps "
             "the MLP's input, never a chunk's fc1 output and activations (5 ffn values a token with SwiGLU), at the cost of "
             "one more MLP forward in backward; the planner's memory and time models and the start-up profile count it "
             "so. For documents of millions of tokens. Same weights, the gradients equal within fp32 rounding. 0: off, the "
             "whole chunk's MLP (default 0)")

    def apply(self, shape: ModelShape) -> ModelShape:
        """``shape`` with these options' blocks (what its memory and time models count)."""
        return replace(shape, loss_chunk_tokens=self.loss_chunk_tokens, mlp_chunk_tokens=self.mlp_chunk_tokens)


@dataclass(frozen=True)
class PlannerOptions:
    """The planner's ``--epp-*`` options as a command line gives them; each defaults to None (each command line fills
    in its own defaults, shown in its help). Their tags (:mod:`~megatron_epp.base.option_tags`) are what
    ``pretrain_gpt.py`` reads of them: which apply only with ``--elastic-pp``, which its layout search refuses."""

    plan: str | None = option("--epp-plan", tags=(ELASTIC_ONLY,), choices=list(BUILDERS),
                              help="plan builder: elastic (EPP), megatron = packing only, seq1f1b = fixed slices")
    memory_budget: float | None = option("--epp-memory-budget", tags=(ELASTIC_ONLY,), type=float, help="GB per device for the planner")
    profile: str | None = option(
        "--epp-profile", tags={ELASTIC_ONLY: True, REFUSED_BY_SEARCH: SEARCH_MODELS_THE_PRESET},
        help="cost-model profile: auto (on CUDA a profile measured on this GPU for this dtype, attention kernel and layer "
        "shape: cached, shipped, or measured at start-up; on CPU as cpu) | analytic (FLOPs at an H100's peak x "
        "MFU, for the model's shape) | cpu (the shipped CPU profile measured nearest the model) | test-model | llama-7b | "
        "llama-13b | llama-30b, or a profile JSON path")
    recompute: str | None = option("--epp-recompute", tags=(ELASTIC_ONLY,), choices=RECOMPUTE_MODES,
                                   help="per-(stage, chunk) recompute: adaptive = the planner's integer program, greedy = its "
                                   "greedy heuristic, none, or full = every layer")
    max_slices: int | None = option("--epp-max-slices", tags=(ELASTIC_ONLY,), type=int, help="most slices per sequence (seq1f1b: its k)")
    time_limit: float | None = option("--epp-time-limit", tags=(ELASTIC_ONLY,), type=float,
                                      help="wall-clock safety limit of the recompute integer program: seconds per 10,000 "
                                      "nonzeros of the program, at least this (a deterministic node limit bounds the solve first)")
    search_layout: bool = option("--epp-search-layout", default=False, action="store_true",
                                 help="search the parallel layout (TP x CP x PP x DP; CP: --context-parallel-size with "
                                 "--elastic-pp) for this world size, model and length distribution on the --epp-cluster "
                                 "preset; print the best flags and exit")
    longest_document: bool = option("--epp-longest-document", default=False, action="store_true",
                                    help="with --epp-search-layout: also the longest single document each layout it planned "
                                    "fits (a multiple of 65,536 tokens: doubled, then bisected with the planner's own "
                                    "feasibility check), without offload and with the --epp-offload mode given, with the "
                                    "host memory and step time it needs; seconds a layout, minutes with --epp-offload auto")
    cluster: str | None = option("--epp-cluster", choices=sorted(CLUSTERS),
                                 help=f"cluster preset of --epp-search-layout (default {DEFAULT_CLUSTER}); with --epp-offload "
                                 "also its host memory and copy bandwidth")
    offload: str | None = option("--epp-offload", tags=(ELASTIC_ONLY,), choices=OFFLOAD_MODES,
                                 help="activation offload to pinned host memory, chosen with recompute by the planner's integer "
                                 "program per (stage, chunk): none (default), checkpoints (recompute checkpoints), auto "
                                 "(checkpoints, and split sequences' K/V buffers where the device cannot hold them)")
    host_memory_budget: float | None = option("--epp-host-memory-budget", tags=(ELASTIC_ONLY,), type=float,
                                              help="GB of host memory per GPU for --epp-offload (default: 75%% of the node's "
                                              "host memory, of the --epp-cluster preset, divided among its GPUs)")


