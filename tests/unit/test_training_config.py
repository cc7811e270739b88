"""The typed training configuration (``config/fields.py``): each option one field (its flag in the field's metadata,
the parser generated from the fields), validation makes a new frozen config, and training reads the sections, never
the argparse namespace."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from pathlib import Path

import pytest

from megatron_epp.base.options import Values, derived, field_paths, flags_of, option, walk
from megatron_epp.base.units import GIB
from megatron_epp.base.dims import ParallelDims
from megatron_epp.planner.config import PlannerOptions
from megatron_epp.config import fields as config_module
from megatron_epp.config.parser import build_parser, parse_config, validate
from megatron_epp.config.fields import TrainingConfig
from megatron_epp.config import memory_budget
from megatron_epp.config.megatron_flags import ACCEPTED
from megatron_epp.config.memory_budget import MemoryReading, read_memory as real_read_memory

LIBRARY = Path(config_module.__file__).parent.parent
# the packages that read the config: config itself parses the flags, validates them and turns them into the config
# (and declares the accepted Megatron-LM flags)
READERS = ("training", "model", "measure", "checkpoint")
# command lines of their own (epp-hf-convert, epp-profile-gpu), whose namespaces are not pretrain_gpt.py's: they build
# pretrain_gpt.py's config with parse_config
OTHER_CLIS = {"hf_convert.py", "profile_gpu.py"}
# cfg.flat() and the one-line errors of varied command lines at 8c9e29a, before the options were declared once
BEFORE = Path(__file__).parent.parent / "data" / "config_before_one_declaration.json"


def option_dests(cls: type) -> set[str]:
    return {flags_of(f)[0].dest for _, f, _ in walk(cls) if flags_of(f)}


def test_the_parser_is_generated_from_the_fields():
    """The parser's names are exactly the fields' flags' (and the accepted Megatron-LM flags, which have no effect),
    each with its field's default: both come from the same declaration, so neither can lack the other."""
    parser = build_parser()
    dests = {a.dest: a.default for a in parser._actions if a.default != argparse.SUPPRESS}  # less --help and the refused flags
    assert set(dests) == option_dests(TrainingConfig) | {entry.dest for entry in ACCEPTED}
    defaults = TrainingConfig()
    for key, path in field_paths(TrainingConfig).items():
        if key in dests:
            value = defaults
            for name in path:
                value = getattr(value, name)
            assert dests[key] == value, key
    assert {flags_of(f)[0].dest for _, f, _ in walk(PlannerOptions)} <= set(dests)  # epp-plan's --epp-* options: the same fields


def test_a_flag_without_a_field_is_refused():
    """The planted fault: an ``add_argument`` beside the generated ones lands in no field, and the config refuses it."""
    parser = build_parser()
    parser.add_argument("--epp-new-knob", type=int, default=None)
    with pytest.raises(TypeError, match="parsed options without a field: epp_new_knob"):
        TrainingConfig.from_namespace(parser.parse_args(["--mock-data"]))
    assert TrainingConfig.from_namespace(build_parser().parse_args(["--mock-data"])).data.mock_data


def test_a_field_without_a_flag_is_refused():
    """A field is an option or derived: a plain one (neither) cannot be placed, and two fields of one name cannot either."""

    @dataclasses.dataclass(frozen=True)
    class Planted:
        lr: float = option("--lr", type=float, default=1.0, help="x")
        knob: int = 3

    with pytest.raises(TypeError, match="field knob has no flag and is not derived"):
        field_paths(Planted)

    @dataclasses.dataclass(frozen=True)
    class Fine:
        lr: float = option("--lr", type=float, default=1.0, help="x")
        knob: int = derived(3)

    @dataclasses.dataclass(frozen=True)
    class Twice:
        a: Fine = dataclasses.field(default_factory=Fine)
        lr: float = derived()

    assert field_paths(Fine) == {"lr": ("lr",), "knob": ("knob",)}
    with pytest.raises(TypeError, match=r"lr: two fields \(a.lr, lr\)"):
        field_paths(Twice)


def test_validation_returns_a_new_config_and_changes_no_value_in_place():
    raw = TrainingConfig.from_namespace(build_parser().parse_args(["--mock-data", "--lr-warmup-iters", "2", "--train-iters", "5"]))
    cfg = validate(raw, 1)
    assert (raw.optim.lr_warmup_samples, raw.training.global_batch_size, raw.parallel.dims) == (0, None, None)  # as given
    assert (cfg.optim.lr_warmup_samples, cfg.optim.lr_warmup_iters, cfg.training.global_batch_size) == (2, 2, 1)
    assert cfg.parallel.dims == ParallelDims()
    with pytest.raises(AttributeError, match="read-only"):
        cfg.values().lr = 1.0
    assert isinstance(cfg.values(), Values) and cfg.values().lr_warmup_iters == 2


def cases() -> dict:
    return json.loads(BEFORE.read_text())


def fixture_reading() -> MemoryReading:
    """The device memory the fixture's default budgets were computed from (a made-up 64 GiB host: ``tests/host.py``)."""
    return MemoryReading(**cases()["memory_reading"])


# Megatron-LM's fusion flags, accepted without effect at 8c9e29a, are options now (docs/gpu.md, fused kernels)
BECAME_OPTIONS = {"--cross-entropy-loss-fusion": ("model.cross_entropy_loss_fusion", True),
                  "--no-rope-fusion": ("model.rope_fusion", False)}


def config_of_case(name: str, data: Path, memory: MemoryReading | None) -> tuple[dict, dict]:
    """Case ``name``'s expected ``flat`` and the config its command line gives now (``memory``: the reading given to
    ``parse_config``; None: the reading the process makes)."""
    for prefix in ("a", "b"):
        (data / f"{prefix}.bin").touch()
        (data / f"{prefix}.idx").touch()
    case = json.loads(json.dumps(cases()["good"][name]).replace("{DATA}", str(data)))
    expected = case["flat"]
    if "accepted_flags" in expected:  # the fusion flags accepted at 8c9e29a are options now
        expected = {**expected, "accepted_flags": [f for f in expected["accepted_flags"] if f not in BECAME_OPTIONS]}
    return expected, parse_config(case["argv"], world_size=case["world_size"], memory=memory).flat()


@pytest.mark.parametrize("name", sorted(cases()["good"]))
def test_the_same_config_as_before_the_options_were_declared_once(name, tmp_path):
    """Each command line gives the config it gave at 8c9e29a; the keys added are the options validation folded
    before (now fields of their own: ``optim.lr_warmup_iters`` beside ``optim.lr_warmup_samples``) and the options
    added since, at their defaults. The default budgets are those of the fixture's memory reading (given), not the
    host's."""
    expected, flat = config_of_case(name, tmp_path, fixture_reading())
    given = [flag for flag in BECAME_OPTIONS if flag in cases()["good"][name]["argv"]]
    assert {key: flat.get(key, "missing") for key in expected} == expected
    folded = {"data.tokenizer", "model.use_rotary_position_embeddings", "epp.plan", "epp.memory_budget", "epp.profile",
              "epp.recompute", "epp.max_slices", "epp.time_limit"} | {f"optim.lr_{n}" for n in (
              "warmup_iters", "warmup_fraction", "decay_iters", "wsd_decay_iters", "wsd_decay_samples")} | {
              f"parallel.{n}" for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                                        "virtual_pipeline_model_parallel_size", "cp_comm_type", "sequence_parallel")}
    added = {"epp.plan_between_steps": False, "data.sft": False, "model.add_qkv_bias": False, "model.qk_layernorm": False,
             "epp.offload": None, "epp.host_memory_budget": None,
             "model.rope_fusion": True, "model.bias_swiglu_fusion": True, "model.cross_entropy_loss_fusion": False,
             "model.deterministic_mode": False, "epp.loss_chunk_tokens": 0,
             "epp.mlp_chunk_tokens": 0, "epp.longest_document": False}  # options added after 8c9e29a, at their defaults (no command line gives them)
    added |= {"epp.planner.offload": "none", "epp.planner.host_memory_budget_bytes": None} if "epp.planner.offload" in flat else {}
    assert set(flat) - set(expected) == folded | set(added)
    added |= dict(BECAME_OPTIONS[flag] for flag in given)
    assert {key: flat[key] for key in added} == added


class _Host:
    def __init__(self, total: float, available: float) -> None:
        self.total, self.available = total, available


@pytest.mark.parametrize("ram_gib, available_gib", [(7, 1), (25276063744 / GIB, 20), (2048, 1900)])
def test_the_fixture_holds_on_a_host_of_any_memory(monkeypatch, tmp_path, ram_gib, available_gib):
    """On a host of another RAM size and free memory (faked where the process reads them: psutil, no GPU), the
    fixture's expectations still hold: every case that derives a default budget takes it from the reading given; the
    same case left to read the machine gets the faked host's budget (the fake is what the reader sees)."""
    monkeypatch.setattr(memory_budget, "read_memory", real_read_memory)
    monkeypatch.setattr(memory_budget.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(memory_budget.psutil, "virtual_memory", lambda: _Host(ram_gib * GIB, available_gib * GIB))
    budgeted = [name for name, case in cases()["good"].items() if case["flat"].get("epp.default_budget.device") == "cpu"]
    assert len(budgeted) >= 5
    for name in budgeted:
        expected, flat = config_of_case(name, tmp_path, fixture_reading())
        assert {key: flat.get(key, "missing") for key in expected} == expected, name
        world = cases()["good"][name]["world_size"]
        read = config_of_case(name, tmp_path, None)[1]
        assert read["epp.default_budget.total"] == ram_gib * GIB and read["epp.planner.memory_budget_bytes"] == pytest.approx(0.9 * ram_gib * GIB / world)


def test_the_same_one_line_errors_as_before(capsys):
    for line, message in cases()["bad"].items():
        with pytest.raises(ValueError) as error:
            parse_config(["--mock-data", *line.split()], world_size=2)
        assert str(error.value) + capsys.readouterr().err == message, line


def test_the_budget_is_bytes_inside_and_the_planner_options_one_value():
    cfg = parse_config(["--mock-data", "--elastic-pp", "--epp-memory-budget", "1.5", "--epp-max-slices", "3",
                        "--epp-recompute", "greedy", "--epp-calibrate-interval", "7"], world_size=1)
    assert cfg.epp.planner.memory_budget_bytes == 1.5 * GIB and cfg.epp.default_budget is None
    assert (cfg.epp.planner.max_slices, cfg.epp.planner.recompute, cfg.epp.calibrate_interval) == (3, "greedy", 7)
    stock = parse_config(["--mock-data"], world_size=1)
    assert stock.epp.planner is None and not stock.epp.enabled and stock.epp.search_layout is False


def test_the_config_is_frozen_and_changed_by_copy():
    cfg = parse_config(["--mock-data"], world_size=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.vocab_size = 64  # type: ignore[misc]
    small = cfg.replace(model={"vocab_size": 64}, parallel={"use_distributed_optimizer": True})
    assert (small.model.vocab_size, small.parallel.use_distributed_optimizer) == (64, True)
    assert (cfg.model.vocab_size, cfg.parallel.use_distributed_optimizer) == (257, False)


def test_accepted_megatron_flags_are_recorded_for_the_startup_line():
    cfg = parse_config(["--mock-data", "--use-mcore-models", "--num-workers", "4"], world_size=1)
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
    """The config package parses the namespace into the config and validates it; every module of the packages above
    it reads the config's sections only."""
    modules = [path for package in READERS for path in sorted((LIBRARY / package).glob("*.py")) if path.name not in OTHER_CLIS]
    assert len(modules) >= 25
    reads = [hit for path in modules for hit in namespace_reads(path)]
    assert reads == []


def test_the_namespace_check_sees_a_planted_read(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(args):\n    return args.tensor_model_parallel_size\n")
    assert namespace_reads(planted) == ["planted.py:2: args.tensor_model_parallel_size"]


def test_main_takes_a_config(tmp_path, capsys):
    """``pretrain_gpt.py``'s main runs a config (here up to a check that ends the run before any process group: one
    line); ``pretrain_gpt.run`` parses the flags into it."""
    import pretrain_gpt
    from megatron_epp.training.main import main

    missing = tmp_path / "none"
    flags = ["--mock-data", "--load", str(missing), "--exit-on-missing-checkpoint"]
    for run in (lambda: main(parse_config(flags, world_size=1)), lambda: pretrain_gpt.run(flags)):
        assert run() == 2
        assert capsys.readouterr().err == f"pretrain_gpt.py: error: --load {missing}: no checkpoint there (--exit-on-missing-checkpoint)\n"
