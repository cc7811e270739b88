"""What an option field carries besides its flag (``base/options.py``): tags, found by :func:`fields_tagged` and
:func:`tag_values`, and a numeric range (:class:`Range`, :func:`range_problem`); and the lists validation used to
spell out, now made from them, pinned as they were written out before (at e8fc223)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from megatron_epp.base.option_tags import ELASTIC_ONLY, REFUSED_BY_SEARCH
from megatron_epp.base.options import RANGE, Range, derived, fields_tagged, key_of, option, range_problem, tag_values, walk
from megatron_epp.config import validation
from megatron_epp.config.fields import EPPConfig, TrainingConfig


@dataclass(frozen=True)
class Inner:
    depth: int = option("--depth", tags={"shape": 1}, default=2, type=int, at_least=1, help="layers")
    width: int = option("--width", tags={"shape": 0, "other": "why"}, default=8, type=int, above=0, help="units")


@dataclass(frozen=True)
class Outer:
    rate: float = option("--rate", tags=("marked",), default=0.5, type=float, at_least=0, below=1, help="a probability")
    inner: Inner = field(default_factory=Inner)
    fused: bool = option("--no-fused", tags=("marked",), default=True, action="store_false", dest="fused_kernels", help="off")
    computed: int | None = derived()


def test_fields_tagged_gives_the_keys_in_declaration_order_through_sections():
    """Keys are the flags' dests (``--no-fused``: ``fused_kernels``), nested sections in their place; an iterable of
    tags marks each with True, a mapping gives each its value."""
    assert fields_tagged(Outer, "marked") == ("rate", "fused_kernels")
    assert fields_tagged(Outer, "shape") == ("depth", "width")
    assert tag_values(Outer, "shape") == {"depth": 1, "width": 0}
    assert tag_values(Outer, "other") == {"width": "why"}
    assert tag_values(Outer, "marked") == {"rate": True, "fused_kernels": True}
    assert fields_tagged(Outer, "nothing") == ()


def test_range_bounds_and_their_one_line_problems():
    assert Range.of(None, None, None, None) is None
    assert Range.of(1, None, None, None).problem(0) == "must be >= 1"
    assert Range.of(1, None, None, None).problem(1) is None
    assert Range.of(None, 0, None, None).problem(0) == "must be > 0"
    assert Range.of(0, None, 1, None).problem(1) is None
    assert Range.of(0, None, 1, None).problem(1.5) == "must be in [0, 1]"
    assert Range.of(0, None, None, 1).problem(1) == "must be in [0, 1)"
    assert Range.of(0, None, None, 1).problem(-0.1) == "must be in [0, 1)"
    assert Range.of(1, None, None, None).problem(math.nan) == "must be >= 1"  # a NaN is outside every range
    for bad in ((1, 0, None, None), (0, None, 1, 1), (None, None, 1, None)):
        with pytest.raises(TypeError):
            Range.of(*bad)


def test_range_problem_names_the_first_flag_outside_its_range():
    values = SimpleNamespace(rate=0.5, depth=2, width=8, fused_kernels=True, computed=None)
    assert range_problem(Outer, values) is None
    assert range_problem(Outer, SimpleNamespace(**{**vars(values), "width": 0})) == "--width 0: must be > 0"
    assert range_problem(Outer, SimpleNamespace(**{**vars(values), "rate": 1.0, "depth": 0})) == "--rate 1.0: must be in [0, 1)"
    assert range_problem(Outer, SimpleNamespace(**{**vars(values), "depth": None})) is None  # None: left to its default


# validation's lists as validation.py spelled them out at e8fc223
AT_LEAST_ONE = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "max_position_embeddings",
                "vocab_size", "micro_batch_size", "global_batch_size", "train_samples", "lr_decay_iters", "lr_decay_samples",
                "eval_interval", "save_interval")
AT_LEAST_ZERO = ("lr", "min_lr", "lr_warmup_iters", "lr_warmup_samples", "weight_decay", "clip_grad", "init_method_std",
                 "eval_iters", "decoupled_lr", "decoupled_min_lr", "adam_eps", "sgd_momentum", "manual_gc_interval",
                 "epp_loss_chunk_tokens", "epp_mlp_chunk_tokens")
POSITIVE = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis", "lr_wsd_decay_iters",
            "lr_wsd_decay_samples")
PROBABILITIES = {"hidden_dropout": (0, 1, "]"), "attention_dropout": (0, 1, "]"), "adam_beta1": (0, 1, ")"),
                 "adam_beta2": (0, 1, ")"), "lr_warmup_fraction": (0, 1, ")")}
# as the lists were at e8fc223, and --epp-plan-between-steps, which was accepted without --elastic-pp and then had no effect
ELASTIC_ONLY_OPTIONS = ("epp_plan", "epp_max_slices", "epp_profile", "epp_recompute", "epp_time_limit", "epp_memory_budget",
                        "epp_timeline", "epp_plan_between_steps", "epp_calibrate_interval", "epp_profile_cache",
                        "epp_truncate_documents", "epp_offload", "epp_host_memory_budget")
SEARCH_REFUSES = {
    "epp_profile": "it models the --epp-cluster preset's GPUs for the model the flags describe",
    "epp_timeline": "it prints a layout and exits without training",
    "epp_plan_between_steps": "it prints a layout and exits without training",
    "epp_calibrate_interval": "it prints a layout and exits without training",
    "epp_profile_cache": "it models the --epp-cluster preset's GPUs for the model the flags describe",
}


def ranges(cls: type) -> dict[str, Range]:
    return {key_of(f): f.metadata[RANGE] for _, f, _ in walk(cls) if RANGE in f.metadata}


def test_the_ranges_are_the_lists_as_they_were():
    """Every range of the fields is one the lists checked, and every flag of the lists has its range."""
    want = {**{k: Range(1) for k in AT_LEAST_ONE}, **{k: Range(0) for k in AT_LEAST_ZERO},
            **{k: Range(0, low_open=True) for k in POSITIVE},
            **{k: Range(low, high, high_open=bracket == ")") for k, (low, high, bracket) in PROBABILITIES.items()}}
    assert ranges(TrainingConfig) == want


def test_the_elastic_only_and_search_refused_options_are_the_lists_as_they_were():
    """Validation's options that need --elastic-pp (as a set: the first given one named in the error is now the first
    in declaration order, the --help order) and those --epp-search-layout refuses, with why."""
    assert sorted(validation.ELASTIC_OPTIONS) == sorted(ELASTIC_ONLY_OPTIONS)
    assert len(validation.ELASTIC_OPTIONS) == len(ELASTIC_ONLY_OPTIONS)
    assert validation.SEARCH_REFUSES == SEARCH_REFUSES


@dataclass(frozen=True)
class EPPWithoutTags(EPPConfig):
    """The planted fault: ``--epp-timeline`` declared without its tags (a subclass's field keeps its place)."""

    timeline: str | None = option("--epp-timeline", help="directory: the planned timeline picture of every logged step")


def test_a_forgotten_tag_changes_the_derived_lists():
    """A field without its tags drops out of both lists: the pins above go red."""
    assert "epp_timeline" not in fields_tagged(EPPWithoutTags, ELASTIC_ONLY)
    assert set(fields_tagged(EPPWithoutTags, ELASTIC_ONLY)) == set(ELASTIC_ONLY_OPTIONS) - {"epp_timeline"}
    assert tag_values(EPPWithoutTags, REFUSED_BY_SEARCH) == {k: v for k, v in SEARCH_REFUSES.items() if k != "epp_timeline"}
