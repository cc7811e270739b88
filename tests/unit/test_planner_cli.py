"""The ``epp-plan`` command line and the baselines it reports."""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import types

from megatron_epp.plan import Plan, PlanInfeasible
from megatron_epp.plan.order import format_stage_ops
from megatron_epp.planner.builders import BUILDERS, ELASTIC, MEGATRON, SEQ1F1B, plan_batch
from megatron_epp.planner import cli
from megatron_epp.planner.cli import main
from megatron_epp.planner.compare import BASELINES, run_baselines
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.planner.data_parallel import TOKENS, dp_split
from megatron_epp.cost.features import F
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.network import get_network
from megatron_epp.base.dims import ParallelDims
from megatron_epp.base.units import GIB
from megatron_epp.cost.placement import place_profile, placement_note
from megatron_epp.cost.profile_lookup import load_profile
from megatron_epp.data.mock_documents import lengths_from_file
from megatron_epp.simulator.step import simulate
from megatron_epp.config.parser import parse_config
from megatron_epp.config.errors import ArgumentError
from megatron_epp.training.planning import online_planner
from megatron_epp.measure.profile_resolution import describe, loaded_profile, startup_profile

LENGTHS = [3000, 1200, 800, 500, 300, 200, 150, 90, 60, 40, 20, 10] * 2


@pytest.fixture
def lengths_file(tmp_path):
    path = tmp_path / "lengths.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(map(str, LENGTHS)) + "\n")
    return path


def run_json(capsys, *argv: str) -> dict:
    main([*argv, "--json"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_json_has_plan_and_every_baseline(lengths_file, capsys, tmp_path):
    out = run_json(capsys, str(lengths_file), "--epp-profile", "test-model", "--stages", "2", "--epp-memory-budget", "0.2",
                   "--network", "cpu-local", "--max-seq-len", "4096", "--timeline", str(tmp_path / "t.png"), "--plan-out", str(tmp_path / "p.json"))
    for key in ("solve_ms", "num_chunks", "num_pipelines", "recomputed_layers", "predicted_step_ms", "bound_step_ms", "peak_memory_gb", "mip_gap"):
        assert key in out
    assert set(out["num_chunks"]) == {"batched", "split", "hybrid"} and len(out["peak_memory_gb"]) == 2
    assert max(out["peak_memory_gb"]) <= 0.2
    assert set(out["baselines"]) == set(BASELINES)
    for b in out["baselines"].values():
        assert ("predicted_step_ms" in b and "peak_memory_gb" in b) if b["fits"] else "reason" in b
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert json.loads((tmp_path / "p.json").read_text())["num_stages"] == 2


def test_memory_is_in_bytes_inside_and_in_gb_in_the_cli_json(lengths_file, capsys, tmp_path):
    """A plan's report holds its simulated peak per stage and the budget in bytes, as do the baselines' summaries; the
    JSON gives them in GB under its own keys (``peak_memory_gb``, ``memory_budget_gb``), converted only there;
    ``--plan-out`` writes the plan, what to run, without the report."""
    argv = [str(lengths_file), "--epp-profile", "test-model", "--stages", "2", "--epp-memory-budget", "0.2",
            "--network", "cpu-local", "--max-seq-len", "4096", "--baselines", "megatron,flexsp"]
    config, profile, lengths = cli.check_input(cli.parse_args(argv))
    cm = CostModel(profile, 2, network=get_network("cpu-local"))
    step = plan_batch(lengths, cm, config)
    assert step.report.peak_memory_bytes == simulate(step.plan, cm).peak_memory.tolist()
    assert step.report.memory_budget_bytes == config.memory_budget_bytes == 0.2 * GIB
    out = run_json(capsys, *argv, "--plan-out", str(tmp_path / "p.json"))
    text = (tmp_path / "p.json").read_text()
    assert Plan.from_json(text) == step.plan and "stats" not in json.loads(text) and "report" not in json.loads(text)
    assert out["peak_memory_gb"] == [b / GIB for b in step.report.peak_memory_bytes] and out["memory_budget_gb"] == 0.2
    baselines = run_baselines(lengths, cm, config, ["megatron", "flexsp"])
    for name, summary in baselines.items():
        assert summary["fits"] and out["baselines"][name]["fits"], name
        assert out["baselines"][name]["peak_memory_gb"] == [b / GIB for b in summary["peak_memory_bytes"]], name
        assert "peak_memory_bytes" not in out["baselines"][name], name


def test_cli_prints_replica_0s_schedule(lengths_file, capsys, tmp_path):
    main([str(lengths_file), "--epp-profile", "test-model", "--stages", "4", "--dp", "2", "--max-seq-len", "4096", "--baselines", "",
          "--print-schedule", "--plan-out", str(tmp_path / "p.json"), "--json"])
    out = capsys.readouterr().out
    table = format_stage_ops(Plan.from_json((tmp_path / "p.json").read_text()))
    assert table.splitlines()[0].split() == ["Stage", "0", "Stage", "1", "Stage", "2", "Stage", "3"]
    assert "\n" + table + "\n" in out and json.loads(out.splitlines()[-1])["dp"] == 2


def test_cli_truncates_too_long_documents_when_asked(lengths_file, capsys, tmp_path):
    out = run_json(capsys, str(lengths_file), "--epp-profile", "test-model", "--stages", "2", "--max-seq-len", "1000", "--truncate",
                   "--baselines", "", "--gbs", "10", "--seed", "3", "--epp-memory-budget", "0.5", "--plan-out", str(tmp_path / "p.json"))
    planned = json.loads((tmp_path / "p.json").read_text())["seq_lengths"]
    assert out["num_sequences"] == len(planned) == 10 and out["num_tokens"] == sum(planned) <= 10 * 1000
    # the documents over the cap are cut to it (1000 tokens), not dropped or shortened further; the others are as drawn
    assert 1000 in planned and all(n == 1000 or n in LENGTHS for n in planned), planned


def test_cli_preset_with_data_parallel_split(lengths_file, capsys, tmp_path):
    out = run_json(capsys, str(lengths_file), "--epp-profile", "llama-7b", "--dp", "2", "--baselines", "megatron",
                   "--plan-out", str(tmp_path / "p.json"))
    assert out["dp"] == 2 and out["predicted_step_ms"] > out["bound_step_ms"] > 0
    # replica 0 plans the sequences of the one split training makes: by the cost model's work
    parts = dp_split(np.array(LENGTHS), 2, CostModel(load_profile("llama-7b"), 4, dp=2).work_vector())
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(LENGTHS)))
    assert json.loads((tmp_path / "p.json").read_text())["seq_lengths"] == np.array(LENGTHS)[parts[0]].tolist()
    tokens = dp_split(np.array(LENGTHS), 2, TOKENS)
    assert abs(sum(np.array(LENGTHS)[tokens[0]]) - sum(np.array(LENGTHS)[tokens[1]])) <= 10


def test_cli_splits_data_parallel_by_modelled_work(tmp_path, capsys):
    lengths = np.array([3000, 1200, 800, 500, 300, 200, 150, 90, 60, 40, 20, 10, 5000, 2600, 2500])
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths)))
    # a per-segment cost large enough to move the split (the shipped CPU profile's is small): modelled work, every term
    base = load_profile("test-model")
    profile = replace(base, fwd=replace(base.fwd, bs=2.0), bwd=replace(base.bwd, bs=4.0))
    profile.save(tmp_path / "profile.json")
    run_json(capsys, str(path), "--epp-profile", str(tmp_path / "profile.json"), "--stages", "2", "--dp", "2", "--epp-memory-budget", "0.5",
             "--max-seq-len", "8192", "--baselines", "", "--plan-out", str(tmp_path / "p.json"))
    work = CostModel(load_profile(str(tmp_path / "profile.json")), 2, dp=2).work_vector()  # whole sequences: 1 segment, 1 chunk each
    no_segment = work.copy()
    no_segment[F.SEGMENTS] = 0.0
    parts, by_tokens, by_no_segment = (dp_split(lengths, 2, w) for w in (work, TOKENS, no_segment))
    assert parts[0].tolist() != by_tokens[0].tolist() and parts[0].tolist() != by_no_segment[0].tolist()  # the check discriminates
    assert json.loads((tmp_path / "p.json").read_text())["seq_lengths"] == lengths[parts[0]].tolist()


def test_cli_takes_the_planner_options(lengths_file, capsys):
    base = [str(lengths_file), "--epp-profile", "test-model", "--stages", "2", "--epp-memory-budget", "0.5", "--max-seq-len", "4096", "--baselines", ""]
    out = run_json(capsys, *base, "--epp-plan", "megatron", "--epp-recompute", "none")
    assert out["num_chunks"]["split"] == 0 and out["mip_gap"] == 0.0  # megatron packs whole sequences
    out = run_json(capsys, *base, "--epp-recompute", "none", "--epp-max-slices", "1", "--epp-time-limit", "0.5")
    assert out["recomputed_layers"] == 0
    with pytest.raises(SystemExit):  # the old spellings are gone
        main([*base, "--memory-gb", "0.5"])


def test_cli_plans_a_long_document_with_the_chunked_head_and_the_tiled_mlp(tmp_path, capsys):
    """One 1.5M-token document on llama-7b at TP 8, one stage, 80 GB, no offload: no plan fits with the whole head and
    MLP (the layer's MLP activations and the head's logits of the whole document), one fits with
    ``--epp-loss-chunk-tokens 4096 --epp-mlp-chunk-tokens 8192`` (the model's shape the planner counts)."""
    doc = tmp_path / "one.txt"
    doc.write_text("1500000\n")
    base = [str(doc), "--epp-profile", "llama-7b", "--tp", "8", "--stages", "1", "--max-seq-len", "1500000", "--baselines", ""]
    with pytest.raises(SystemExit):
        main(base)
    assert "no 'adaptive' plan fits 80.0 GB per GPU" in capsys.readouterr().err
    out = run_json(capsys, *base, "--epp-loss-chunk-tokens", "4096", "--epp-mlp-chunk-tokens", "8192")
    assert out["num_chunks"] == {"batched": 1, "split": 0, "hybrid": 0} and max(out["peak_memory_gb"]) <= 80.0


def test_the_epp_options_are_declared_once_for_both_command_lines(monkeypatch):
    """``epp-plan`` and ``pretrain_gpt.py`` generate their ``--epp-*`` planner options from the same fields
    (``PlannerOptions``): the same flags, choices and help, each command line's own default added to the help."""
    from megatron_epp.base.options import flags_of, walk
    from megatron_epp.planner.config import PlannerOptions, ShapeOptions
    from megatron_epp.config.parser import build_parser

    seen = {}
    monkeypatch.setattr(cli.argparse.ArgumentParser, "parse_args", lambda self, argv=None: seen.setdefault("parser", self))
    cli.parse_args([])
    flags = {flags_of(f)[0].name for cls in (PlannerOptions, ShapeOptions) for _, f, _ in walk(cls)}
    assert {"--epp-loss-chunk-tokens", "--epp-mlp-chunk-tokens"} <= flags

    def options(parser) -> dict:
        return {a.option_strings[0]: (a.choices, re.sub(r" \(default [^)]*\)$", "", a.help)) for a in parser._actions
                if a.option_strings and a.option_strings[0] in flags}

    assert len(options(seen["parser"])) == len(flags) and options(seen["parser"]) == options(build_parser())
    helps = [{a.option_strings[0]: a.help for a in parser._actions if a.option_strings}["--epp-profile"]
             for parser in (seen["parser"], build_parser())]
    assert helps[0].endswith("JSON path (default llama-13b)") and helps[1].endswith("JSON path (default auto)")


def test_baselines_shapes_and_infeasibility():
    cm = CostModel(load_profile("test-model"), 2)
    config = PlannerConfig(memory_budget_bytes=1.0 * GIB, max_seq_len=4096)
    meg = MEGATRON.plan(LENGTHS, cm, config).plan
    assert {c.kind for c in meg.chunks()} == {"batched"} and all(c.num_tokens <= 4096 for c in meg.chunks())
    assert len({r for p in meg.pipelines for row in p.recompute for r in row}) == 1  # uniform recompute
    s1 = SEQ1F1B.plan(LENGTHS, cm, config).plan  # k = 4 by default
    assert [sum(1 for c in s1.chunks() if any(s.seq == 0 for s in c.segments))] == [4]  # 3000 > 4096/4: 4 slices
    assert s1.builder == SEQ1F1B.at(4).plan_name == "seq1f1b-k4"
    k2 = SEQ1F1B.at(2)
    assert k2.plan(LENGTHS, cm, config).plan.builder == "seq1f1b-k2" == k2.name  # the record's k, not the config's
    assert k2.plan(LENGTHS, cm, config).plan.pipelines == SEQ1F1B.plan(LENGTHS, cm, PlannerConfig(1.0 * GIB, 4096, max_slices=2)).plan.pipelines
    assert set(BUILDERS) == {"elastic", "megatron", "seq1f1b"} and all(BUILDERS[b.flag] is b for b in (ELASTIC, MEGATRON, SEQ1F1B))
    assert k2.flags() == ["--epp-plan", "seq1f1b", "--epp-max-slices", "2"]
    assert (k2.configure(config).builder, k2.configure(config).max_slices) == (SEQ1F1B, 2)  # the record, not its name
    assert plan_batch(LENGTHS, cm, k2.configure(config)).plan.pipelines == k2.plan(LENGTHS, cm, config).plan.pipelines
    via_registry = plan_batch(LENGTHS, cm, PlannerConfig(1.0 * GIB, 4096, builder=MEGATRON))
    assert via_registry.plan.builder == "megatron" and via_registry.plan.pipelines == meg.pipelines
    # the flag's name becomes the record at the edge (PlannerConfig.from_options); inside, a name is no builder
    assert parse_config(["--elastic-pp", "--mock-data", "--epp-plan", "seq1f1b"], world_size=1).epp.planner.builder is SEQ1F1B
    with pytest.raises(ValueError, match="--epp-plan 'megatron': one of elastic, megatron, seq1f1b"):
        PlannerConfig(1.0 * GIB, 4096, builder="megatron")
    res = run_baselines(LENGTHS, cm, PlannerConfig(0.004 * GIB, 4096))  # 4 MB: not even the model states fit
    assert not any(r["fits"] for r in res.values())



def cli_error(capsys, monkeypatch, *argv: str) -> str:
    """epp-plan's error for ``argv``: one line on stderr, exit 2 (as argparse's), before any planning."""
    def no_planning(*args, **kwargs):
        raise AssertionError("planned before the input was checked")

    monkeypatch.setattr(cli, "plan_batch", no_planning)
    monkeypatch.setattr(cli, "search_for_world", no_planning)
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("epp-plan: error: "), err
    return err.removeprefix("epp-plan: error: ").rstrip("\n")


@pytest.mark.parametrize("argv, message", [
    (["--epp-profile", "llama-30b", "--stages", "7"], "--stages 7: the 60 layers of llama-30b do not divide into 7 pipeline stages"),
    (["--epp-profile", "llama-13b", "--tp", "3"], "--tp 3: the 40 attention heads of llama-13b do not divide into 3 tensor-parallel ranks"),
    (["--epp-profile", "llama-30b", "--tp", "8"], "--tp 8: the 52 attention heads of llama-30b do not divide into 8 tensor-parallel ranks"),
    (["--epp-profile", "test-model", "--tp", "8"], "--tp 8: the 4 attention heads of test-model do not divide into 8 tensor-parallel ranks"),
    (["--tp", "0"], "--tp 0: must be >= 1"),
    (["--stages", "0"], "--stages 0: must be >= 1"),
    (["--dp", "-1"], "--dp -1: must be >= 1"),
    (["--gbs", "0"], "--gbs 0: must be >= 1"),
    (["--gbs", "-3"], "--gbs -3: must be >= 1"),
    (["--max-seq-len", "0", "--truncate"], "--max-seq-len 0: must be >= 1"),
    (["--seed", "-1"], "--seed -1: must be >= 0"),
    (["--baselines", "megatron,nosuch"], "--baselines 'nosuch': one of megatron, seq1f1b, epp-no-ckpt, epp-full-ckpt, epp-no-balance, flexsp (comma-separated; empty for none)"),
    (["--plan-out", "{tmp}/no/p.json"], "--plan-out {tmp}/no/p.json: no such directory {tmp}/no"),
    (["--timeline", "{tmp}/no/t.png"], "--timeline {tmp}/no/t.png: no such directory {tmp}/no"),
    (["--epp-max-slices", "0"], "--epp-max-slices must be >= 1"),
    (["--epp-mlp-chunk-tokens", "-1"], "--epp-mlp-chunk-tokens -1: must be >= 0"),
    (["--epp-longest-document"], "--epp-longest-document applies only with --epp-search-layout"),
    (["--epp-loss-chunk-tokens", "-2"], "--epp-loss-chunk-tokens -2: must be >= 0"),
    (["--epp-profile", "nope"], "--epp-profile 'nope': not a preset (auto, analytic, cpu, test-model, llama-7b, llama-13b, llama-30b) nor a file"),
    (["--epp-profile", "analytic"], "--epp-profile analytic: needs the model's shape (pretrain_gpt.py; epp-plan takes a preset)"),
    (["--epp-cluster", "a800-ib-node"], "--epp-cluster applies only with --epp-search-layout or --epp-offload"),
    (["--epp-search-layout", "--epp-profile", "test-model"], "--epp-search-layout needs a model preset --epp-profile (llama-7b, llama-13b, llama-30b)"),
    (["--epp-search-layout", "--epp-plan", "megatron"], "--epp-plan megatron: --epp-search-layout searches EPP's (elastic) layout"),
    (["--tp", "2", "--epp-profile", "cpu", "--max-seq-len", "4096"], "--baselines flexsp: FlexSP needs the per-GPU (tp=1) costs, and this "
     "measured profile is for tp=2: a tp=1 or an analytic profile (leave flexsp out of --baselines, or pass a model preset --epp-profile)"),
    (["--max-seq-len", "1000"], "--max-seq-len 1000: 4 document(s) longer than the cap (longest 3000 tokens); pass --truncate to cut them"),
])
def test_cli_rejects_bad_options_in_one_line(lengths_file, capsys, monkeypatch, tmp_path, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli_error(capsys, monkeypatch, str(lengths_file), *argv) == message.replace("{tmp}", str(tmp_path))


@pytest.mark.parametrize("text, message", [
    (None, "No such file or directory"),
    ("100\n\nabc\n", "line 3: 'abc' is not a positive token count (one per line)"),
    ("100\n0\n", "line 2: '0' is not a positive token count (one per line)"),
    ("\n\n", "no lengths (one token count per line)"),
])
def test_a_bad_lengths_file_is_one_line_naming_it(tmp_path, capsys, monkeypatch, text, message):
    """The one reader's errors, for epp-plan (exit 2) and the mock documents' lengths alike."""
    path = tmp_path / "lengths.txt"
    if text is not None:
        path.write_text(text)
    assert cli_error(capsys, monkeypatch, str(path)) == f"lengths file {path}: {message}"
    with pytest.raises(ValueError) as e:
        lengths_from_file(path, 4, seed=0)
    assert str(e.value) == f"lengths file {path}: {message}"


def test_a_batch_that_cannot_fit_is_one_line_with_the_reason(tmp_path):
    """30B on 4 stages at TP=8 and 20 GB: the model states take 17.3 GB; a 256K sequence needs at least
    its checkpointed layer inputs (15 layers x 1664 B x 262144 tokens = 6.1 GB) more: refused before any search."""
    cm = CostModel(load_profile("llama-30b", 8), 4)
    with pytest.raises(PlanInfeasible) as e:
        plan_batch([262144, 1000, 500], cm, PlannerConfig(20.0 * GIB, 262144))
    assert str(e.value) == ("model states take 17.3 of 20.0 GB per GPU on stage 3; the longest sequence (262144 tokens) needs "
                            "at least 6.1 GB more (its K/V buffer if split, its checkpointed layer inputs if whole)")
    with pytest.raises(PlanInfeasible, match=r"^model states take 17.3 of 16.0 GB per GPU on stage \d: nothing fits$"):
        plan_batch([1000], cm, PlannerConfig(16.0 * GIB, 262144))


def test_search_layout_world_size_defaults_to_the_presets_tp(lengths_file, monkeypatch, capsys):
    """``--epp-search-layout`` without ``--tp``: the world size is the preset's TP (8) x --stages x --dp."""
    worlds = []

    def search(lengths, shape, cluster, world, config):
        worlds.append(world)
        raise ValueError("stop")

    monkeypatch.setattr(cli, "search_for_world", search)
    for tp in ([], ["--tp", "4"]):
        with pytest.raises(SystemExit):
            main([str(lengths_file), "--epp-profile", "llama-7b", "--stages", "2", "--dp", "3", "--epp-search-layout", *tp])
        assert capsys.readouterr().err == "epp-plan: error: stop\n"
    assert worlds == [8 * 2 * 3, 4 * 2 * 3]


def test_a_profile_used_at_another_tp_is_noted_the_same_way_by_both_clis(lengths_file, capsys, monkeypatch, tmp_path):
    """A profile measured at TP=1 used at TP=2: memory re-derived, times as measured, one note (epp-plan: stderr;
    pretrain_gpt.py: its start-up line); one that cannot re-derive its memory is refused, by the one check."""
    measured = load_profile("test-model")
    at2, note = place_profile(measured, ParallelDims(tp=2)), placement_note(measured, ParallelDims(tp=2))
    assert measured.tp == 1 and at2.tp == 2 and at2.fwd == measured.fwd
    assert place_profile(measured, ParallelDims()) is measured and placement_note(measured, ParallelDims()) is None
    assert note.startswith("the profile 'CPU x86_64 (1 thread, fp32, sdpa-merged)' was measured at TP=1; at TP=2 its activation memory is re-derived")
    assert CostModel(at2, 2).profile.memory.act_token < CostModel(measured, 2).profile.memory.act_token
    base = [str(lengths_file), "--epp-profile", "test-model", "--stages", "2", "--max-seq-len", "4096", "--baselines", "", "--epp-plan", "megatron"]
    for tp, err in (("2", f"epp-plan: note: --tp 2: {note}\n"), ("1", "")):
        main([*base, "--tp", tp, "--json"])
        out = capsys.readouterr()
        assert json.loads(out.out.splitlines()[-1])["tp"] == int(tp) and out.err == err
    cfg = parse_config(["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
                        "--global-batch-size", "2", "--elastic-pp", "--tensor-model-parallel-size", "2"], world_size=2)
    resolved = startup_profile(cfg, torch.device("cpu"))
    assert describe(cfg, resolved).endswith(f"; {note})") and resolved.profile.tp == 2
    assert online_planner(cfg, resolved.profile).cost_model.profile.tp == 2 and online_planner(cfg).cost_model.profile.tp == 2
    fixed = tmp_path / "fixed.json"  # memory coefficients as given: usable at its own TP only
    replace(measured, memory=replace(measured.memory, derive="")).save(fixed)
    message = "the profile 'CPU x86_64 (1 thread, fp32, sdpa-merged)' was measured at TP=1 and its activation memory cannot be re-derived for TP=2"
    assert cli_error(capsys, monkeypatch, *base, "--epp-profile", str(fixed), "--tp", "2") == f"--tp 2: {message} (no memory 'derive')"
    with pytest.raises(ArgumentError, match=re.escape(f"--epp-profile: {message}")):
        loaded_profile(cfg.replace(epp={"planner": replace(cfg.epp.planner, profile=str(fixed))}))


def test_a_run_resolves_its_profile_once(monkeypatch):
    """``--elastic-pp`` on the CPU: the profile is resolved once per run, before any work (the budget check, the
    start-up and the planner all read that one); the planted fault (a second check before start-up, or start-up
    resolving again) counts 2."""
    from megatron_epp.measure import profile_resolution
    from megatron_epp.training import step as step_module

    calls = []
    real = profile_resolution.resolve_profile
    monkeypatch.setattr(profile_resolution, "resolve_profile", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = parse_config(["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
                        "--global-batch-size", "2", "--elastic-pp", "--pipeline-model-parallel-size", "2"], world_size=2)
    steps = step_module.ElasticSteps(cfg)
    steps.start(types.SimpleNamespace(device=torch.device("cpu")))
    assert len(calls) == 1 and steps.profile is steps.loaded and steps.checked is steps.loaded.profile
