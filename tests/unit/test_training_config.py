"""The typed training configuration (``training/config.py``): every flag lands in one section field (or is
folded by validation into one, named in ``FOLDED``), the sections carry the namespace's values, the value is
frozen, and training reads the sections, never the argparse namespace."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from megatron_epp.cost.profiles import GIB
from megatron_epp.base.dims import ParallelDims
from megatron_epp.training import config as config_module
from megatron_epp.training.arguments import parse_args
from megatron_epp.training.config import FOLDED, SECTIONS, TrainingConfig, placed_dests, unplaced_flags

TRAINING = Path(config_module.__file__).parent
# where the flags are parsed, validated and turned into the config (and the accepted Megatron-LM flags declared)
FLAG_MODULES = {"arguments.py", "config.py", "megatron_flags.py"}
# a command line of its own (python -m megatron_epp.training.hf_convert), whose namespace is not pretrain_gpt.py's: it builds
# pretrain_gpt.py's config with parse_config
OTHER_CLIS = {"hf_convert.py"}

ARGVS = [
    ["--mock-data"],
    ["--mock-data", "--elastic-pp", "--pipeline-model-parallel-size", "2", "--epp-memory-budget", "3", "--epp-timeline", "t"],
    ["--mock-data", "--epp-search-layout", "--epp-cluster", "a800-ib-node"],
    ["--mock-data", "--train-samples", "64", "--lr-warmup-fraction", "0.1", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "8",
     "--global-batch-size", "4"],
    ["--mock-data", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--swiglu", "--group-query-attention",
     "--num-query-groups", "2", "--use-distributed-optimizer", "--bf16", "--use-mcore-models", "--num-workers", "2",
     "--save", "/tmp/ck", "--tensorboard-dir", "/tmp/tb", "--use-rotary-position-embeddings", "--manual-gc"],
]


@pytest.mark.parametrize("argv", ARGVS)
def test_every_flag_lands_in_a_section(argv):
    args = parse_args(argv, world_size=4)
    assert unplaced_flags(args) == []
    cfg = TrainingConfig.from_args(args)
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(value):
            continue
        for f in dataclasses.fields(value):
            if f.name in ("dims", "planner", "search_layout"):
                continue
            assert getattr(value, f.name) == getattr(args, config_module._dest(type(value), f)), (section.name, f.name)
    assert cfg.parallel.dims == ParallelDims(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                             args.data_parallel_size, sequence_parallel=args.sequence_parallel)
    assert cfg.parallel.dims.world_size == 4


def test_a_flag_without_a_field_is_named():
    """The planted fault: a flag added to the parser but to no section is what the test above catches."""
    args = parse_args(["--mock-data"], world_size=1)
    args.epp_new_knob = 3
    assert unplaced_flags(args) == ["epp_new_knob"]


def test_each_name_has_one_home():
    placed = [config_module._dest(section, f) for section in SECTIONS for f in dataclasses.fields(section)
              if f.name not in ("dims", "planner")]
    assert len(placed) == len(set(placed)) == len(placed_dests())
    assert not placed_dests() & set(FOLDED)


def test_the_budget_is_bytes_inside_and_the_planner_options_one_value():
    cfg = TrainingConfig.from_args(parse_args(["--mock-data", "--elastic-pp", "--epp-memory-budget", "1.5", "--epp-max-slices", "3",
                                               "--epp-recompute", "greedy", "--epp-calibrate-interval", "7"], world_size=1))
    assert cfg.epp.planner.memory_budget_bytes == 1.5 * GIB and cfg.epp.default_budget is None
    assert (cfg.epp.planner.max_slices, cfg.epp.planner.recompute, cfg.epp.calibrate_interval) == (3, "greedy", 7)
    stock = TrainingConfig.from_args(parse_args(["--mock-data"], world_size=1))
    assert stock.epp.planner is None and not stock.epp.enabled and stock.epp.search_layout is False


def test_the_config_is_frozen_and_changed_by_copy():
    cfg = TrainingConfig.from_args(parse_args(["--mock-data"], world_size=1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.vocab_size = 64  # type: ignore[misc]
    small = cfg.replace(model={"vocab_size": 64}, parallel={"use_distributed_optimizer": True})
    assert (small.model.vocab_size, small.parallel.use_distributed_optimizer) == (64, True)
    assert (cfg.model.vocab_size, cfg.parallel.use_distributed_optimizer) == (257, False)


def test_accepted_megatron_flags_are_recorded_for_the_startup_line():
    cfg = TrainingConfig.from_args(parse_args(["--mock-data", "--use-mcore-models", "--num-workers", "4"], world_size=1))
    assert cfg.accepted_flags == ("--use-mcore-models", "--num-workers")
    flat = cfg.flat()
    assert flat["model.hidden_size"] == 64 and flat["parallel.dims.pp"] == 1 and flat["accepted_flags"] == ["--use-mcore-models", "--num-workers"]


def namespace_reads(path: Path) -> list[str]:
    """``args.X`` / ``argparse.Namespace`` in a training module: the namespace read outside the flag modules."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            found.append(f"{path.name}:{node.lineno}: args.{node.attr}")
        if isinstance(node, ast.Attribute) and node.attr == "Namespace":
            found.append(f"{path.name}:{node.lineno}: argparse.Namespace")
    return found


def test_training_reads_the_config_not_the_namespace():
    """The flag modules parse and validate the namespace; ``main`` turns it into the config (and accepts a parsed
    namespace as its argument); every other training module reads the config's sections only."""
    reads = [hit for path in sorted(TRAINING.glob("*.py")) if path.name not in FLAG_MODULES | OTHER_CLIS for hit in namespace_reads(path)]
    assert reads and all(hit.startswith("main.py:") and hit.endswith(": argparse.Namespace") for hit in reads), reads


def test_the_namespace_check_sees_a_planted_read(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(args):\n    return args.tensor_model_parallel_size\n")
    assert namespace_reads(planted) == ["planted.py:2: args.tensor_model_parallel_size"]


def test_main_takes_flags_a_namespace_or_a_config(tmp_path, capsys):
    """``pretrain_gpt.py``'s main on its flags, on the validated namespace, or on the config itself (here up to a
    check that ends the run before any process group: the same one line each way)."""
    from megatron_epp.training.arguments import parse_config
    from megatron_epp.training.main import main

    missing = tmp_path / "none"
    flags = ["--mock-data", "--load", str(missing), "--exit-on-missing-checkpoint"]
    for given in (flags, parse_args(flags, world_size=1), parse_config(flags, world_size=1)):
        assert main(given) == 2
        assert capsys.readouterr().err == f"pretrain_gpt.py: error: --load {missing}: no checkpoint there (--exit-on-missing-checkpoint)\n"
