"""``pretrain_gpt.py``'s command line: the parser, generated from :class:`TrainingConfig`'s fields (Megatron-LM's flag
names), and the flags parsed into the options and validated (:mod:`.validation`) into the final frozen config, before
any distributed work."""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from megatron_epp.config.errors import ArgumentError
from megatron_epp.base.units import GIB
from megatron_epp.base.options import add_fields_to_parser
from megatron_epp.config.fields import TrainingConfig
from megatron_epp.config.megatron_flags import add_megatron_flags
from megatron_epp.config.validation import EPP_DEFAULTS, validate
from megatron_epp.config.memory_budget import CPU_FRACTION, CUDA_FRAGMENTATION_SHARE, CUDA_LIBRARY_MARGIN, MemoryReading


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ArgumentError(message)


GROUPS = ("model", "parallelism", "batch", "optimisation", "activation recompute", "data", "elastic pipeline parallelism",
          "checkpointing", "preemption and faults", "logging", "profiling")  # the help's sections, in order


def build_parser() -> argparse.ArgumentParser:
    """The parser, generated from :class:`TrainingConfig`'s fields, and the Megatron-LM flags accepted or refused."""
    p = _Parser(
        prog="pretrain_gpt.py",
        description="Train a GPT with Megatron-Core pipeline parallelism (CPU/gloo or CUDA/NCCL). Flags have "
        "Megatron-LM's names and meanings; where a default differs from Megatron-LM's, the flag's help says so "
        "(\"Megatron-LM: ...\"); Megatron-LM flags that have no effect here, or are refused, are listed last.",
        allow_abbrev=False,
    )
    groups = {title: p.add_argument_group(title) for title in GROUPS}
    budget = (f"the GPU's free memory at start-up less {CUDA_LIBRARY_MARGIN / GIB:.0f} GB and {CUDA_FRAGMENTATION_SHARE:.0%} of it, "
              f"or {CPU_FRACTION:.0%} of RAM / ranks on CPU")
    add_fields_to_parser(p, TrainingConfig, groups, defaults_shown={**EPP_DEFAULTS, "epp_memory_budget": budget})
    add_megatron_flags(p)
    return p


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_config(argv: Sequence[str] | None = None, world_size: int | None = None,
                 memory: MemoryReading | None = None) -> TrainingConfig:
    """The flags parsed into the options (:meth:`TrainingConfig.from_namespace`) and validated (:func:`validate`) into
    the configuration training reads; :class:`ArgumentError` (one line, exit 2) on bad input. ``memory``: the device's
    memory, the default budget's input (None: read now, where the default budget is needed)."""
    parsed = build_parser().parse_args(argv)
    if parsed.num_workers is not None and not parsed.num_workers >= 0:  # accepted without effect, but not any value
        raise ArgumentError(f"--num-workers {parsed.num_workers}: must be >= 0")
    raw = TrainingConfig.from_namespace(parsed)
    return validate(raw, world_size_from_env() if world_size is None else world_size, memory)


