"""The parallel layout search on a toy cluster where every layout can be enumerated, and its flags."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_epp.base.dims import ParallelDims
from megatron_epp.cost.clusters import A800, CLUSTERS, Cluster
from megatron_epp.base.units import GIB
from megatron_epp.cost.shape import MODEL_PRESETS, ModelShape
from megatron_epp.plan import PlanInfeasible
from megatron_epp.planner.cli import main as epp_plan
from megatron_epp.planner.builders import ELASTIC, MEGATRON, SEQ1F1B, baseline_builders
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.planner.data_parallel import dp_split
from megatron_epp.planner import layout as layout_module
from megatron_epp.planner.layout import COMM_OVERLAP, cluster_for_world, enumerate_layouts, search_layout
from megatron_epp.data.lengths import select_batch
from megatron_epp.training import layout_search
from megatron_epp.config.parser import EPP_DEFAULTS, parse_config
from megatron_epp.training.planning import elastic_documents
from pretrain_gpt import run as pretrain_gpt

SHAPE = ModelShape("toy", 4, 512, 8, 2048, 1000, dtype="bfloat16")
TOY = Cluster("toy", A800, 80.0, 2, 2, 200.0, 6.25)  # 2 nodes x 2 GPUs


def lengths() -> np.ndarray:
    return np.minimum(np.random.default_rng(3).lognormal(np.log(2000), 1.2, 48).astype(np.int64) + 16, 32768)


@pytest.fixture(scope="module")
def evaluations() -> dict:
    return {}


@pytest.fixture
def evaluate_layout(monkeypatch, evaluations):
    """``evaluate_layout`` planning each (batch, model, cluster, layout, system, config) once per module: the tests'
    enumerations and ``search_layout``'s own calls (patched in) share the plans. The searches' logic (bounds, proxy
    ranking, pruning, the choice) runs as it is; planning the same layout again would give the same plan."""
    real = layout_module.evaluate_layout

    def once(lengths, shape, cluster, layout, system, config, overlap=COMM_OVERLAP, known=None):
        key = (np.asarray(lengths).tobytes(), repr(shape), repr(cluster), repr(layout), system, repr(config), overlap)
        if key not in evaluations:  # known: baseline plans made before, the same as it would make (same plan)
            try:
                evaluations[key] = real(lengths, shape, cluster, layout, system, config, overlap, known=known)
            except PlanInfeasible as infeasible:
                evaluations[key] = str(infeasible)
        if isinstance(evaluations[key], str):
            raise PlanInfeasible(evaluations[key])
        return evaluations[key]

    monkeypatch.setattr(layout_module, "evaluate_layout", once)
    return once


def test_enumeration_covers_every_layout():
    got = {str(x) for x in enumerate_layouts(SHAPE, TOY)}
    assert got == {"TP1xPP1xDP4", "TP1xPP2xDP2", "TP1xPP4xDP1", "TP2xPP1xDP2", "TP2xPP2xDP1", "TP1xCP2xPP1xDP2", "TP1xCP2xPP2xDP1"}
    assert {str(x) for x in enumerate_layouts(SHAPE, TOY, context_parallel=False)} == {n for n in got if "CP" not in n}


@pytest.mark.parametrize("memory_gb", [80.0, 0.5])
def test_search_returns_the_enumerated_best(evaluate_layout, memory_gb):
    L = lengths()
    config = PlannerConfig(memory_budget_bytes=memory_gb * GIB, max_seq_len=32768)
    steps = {}
    for layout in enumerate_layouts(SHAPE, TOY):
        try:
            r = evaluate_layout(L, SHAPE, TOY, layout, ELASTIC, config)
        except PlanInfeasible:
            continue
        assert r.bound_ms <= r.step_ms  # the bound the search prunes with is a lower bound
        steps[str(layout)] = r.step_ms
    best = min(steps, key=steps.get)
    for kw in ({}, {"exhaustive": True}):
        choice = search_layout(L, SHAPE, TOY, ELASTIC, config, **kw)
        assert str(choice.best.layout) == best and choice.best.step_ms == pytest.approx(steps[best])
        assert "beats" in choice.reason
        if kw.get("exhaustive"):  # the proxy ranking may leave the runner-up out, never the best here
            assert choice.runner_up.step_ms == pytest.approx(sorted(steps.values())[1])


@pytest.mark.parametrize("memory_gb", [80.0, 0.5])
def test_a_capped_search_never_loses_to_a_baseline_best_layout(evaluate_layout, memory_gb):
    """However few layouts EPP plans (``max_evaluated=1``), its choice is no slower than Megatron's or Seq1F1B's
    best layout: the proxy that ranks layouts is the better baseline step, an upper bound of EPP's there."""
    L = lengths()
    config = PlannerConfig(memory_budget_bytes=memory_gb * GIB, max_seq_len=32768)
    epp = search_layout(L, SHAPE, TOY, ELASTIC, config, max_evaluated=1)
    proxy = {}
    for layout in enumerate_layouts(SHAPE, TOY):
        steps = []
        for baseline in (MEGATRON, SEQ1F1B):
            try:
                steps.append(evaluate_layout(L, SHAPE, TOY, layout, baseline, config).step_ms)
            except PlanInfeasible:
                pass
        proxy[str(layout)] = min(steps, default=np.inf)
    # planned: the layout of the best baseline step, that of the TP layouts (what the search without CP plans), and
    # those no baseline plan fits (the proxy cannot rank them)
    tp_proxy = {name: step for name, step in proxy.items() if "CP" not in name}
    allowed = {min(proxy, key=proxy.get), min(tp_proxy, key=tp_proxy.get)} | {name for name, step in proxy.items() if not np.isfinite(step)}
    assert {str(r.layout) for r in epp.evaluated} <= allowed
    for baseline in (MEGATRON, SEQ1F1B):  # both plan on some layout at either budget (none may be skipped)
        other = search_layout(L, SHAPE, TOY, baseline, config, exhaustive=True)
        assert epp.best.step_ms <= other.best.step_ms * (1 + 1e-9), baseline.name


@pytest.mark.parametrize("memory_gb", [80.0, 0.6])  # 0.6 GB: 2 of the 7 layouts plan nothing, 5 are ranked
def test_lazy_proxy_ranking_keeps_the_layouts_a_full_ranking_keeps(evaluate_layout, memory_gb):
    """The proxy ranking plans a layout's replicas only until its proxy step is shown above the ``max_evaluated``-th
    best: the layouts it leaves out are exactly those a ranking on every layout's full proxy step leaves out (the best
    ``max_evaluated`` by (proxy, bound, name), the best ``max_evaluated`` TP layouts and every layout no proxy plan fits
    are kept)."""
    L = lengths()
    config = PlannerConfig(memory_budget_bytes=memory_gb * GIB, max_seq_len=32768)
    proxy, bound = {}, {}
    for layout in enumerate_layouts(SHAPE, TOY):
        steps = []
        for baseline in (MEGATRON, SEQ1F1B):
            try:
                r = evaluate_layout(L, SHAPE, TOY, layout, baseline, config)
            except PlanInfeasible:
                continue
            steps.append(r.step_ms)
            bound[str(layout)] = r.bound_ms
        proxy[str(layout)] = min(steps, default=np.inf)
    assert len(bound) >= 5  # layouts to rank
    for m in (1, 2, 3):
        ranked = sorted((n for n in bound if np.isfinite(proxy[n])), key=lambda n: (proxy[n], bound[n], n))
        left_out = set(ranked[m:]) - set([n for n in ranked if "CP" not in n][:m])
        choice = search_layout(L, SHAPE, TOY, ELASTIC, config, max_evaluated=m)
        assert {n for n, why in choice.skipped.items() if why.startswith("proxy")} == left_out, m
        assert any(" > " in choice.skipped[n] for n in left_out), m  # some shown above without their full proxy step


def test_cp_layouts_never_push_out_what_the_search_without_them_plans(evaluate_layout, monkeypatch):
    """The search with CP layouts plans every layout the search without them plans (the best ``max_evaluated`` TP layouts
    by proxy; one it leaves out may only be pruned by its bound), so EPP's step with CP is never above its step without.
    The cell: 64 CommonCrawl-like documents (``benchmarks/paper_grid.py``'s distribution) for LLaMA 7B on 4 x 8 H100, where
    CP layouts have the best proxy steps: one ranking of all layouts (patched in last) leaves out TP layouts the search
    without CP plans and plans a slower step than that search."""
    pool = np.maximum(np.random.default_rng(0).lognormal(np.log(1000), 1.2, 200_000), 16).astype(np.int64)
    L = np.random.default_rng(1).choice(pool, 64, replace=False)
    shape, cluster = MODEL_PRESETS["llama-7b"], CLUSTERS["h100-ib-gpu"]
    config = PlannerConfig(memory_budget_bytes=80.0 * GIB, max_seq_len=131072, profile="llama-7b")

    def by_proxy(choice) -> set[str]:
        return {name for name, why in choice.skipped.items() if why.startswith("proxy")}

    without = search_layout(L, shape, cluster, ELASTIC, config, context_parallel=False)
    planned = {str(r.layout) for r in without.evaluated}
    with_cp = search_layout(L, shape, cluster, ELASTIC, config)
    assert planned and not planned & by_proxy(with_cp)
    assert with_cp.best.step_ms <= without.best.step_ms * (1 + 1e-9)
    monkeypatch.setattr(layout_module, "_keep_by_proxy", layout_module._rank_by_proxy)  # one ranking of all layouts
    shared = search_layout(L, shape, cluster, ELASTIC, config)
    assert planned & by_proxy(shared) and shared.best.step_ms > without.best.step_ms  # here the ranking matters


def test_known_baseline_plans_give_the_same_epp_plans():
    """The elastic builder of a kept layout weighs the proxy ranking's baseline plans (``known``) instead of making
    them again: the same steps and choices as making them."""
    L = lengths()
    config = PlannerConfig(memory_budget_bytes=80.0 * GIB, max_seq_len=32768)
    for layout in (ParallelDims(tp=1, pp=2, dp=2, cp=1), ParallelDims(tp=1, pp=1, dp=2, cp=2)):
        fresh = layout_module.evaluate_layout(L, SHAPE, TOY, layout, ELASTIC, config)
        cm = layout_module.layout_cost_model(SHAPE, TOY, layout)
        known = []
        for p in dp_split(L, layout.dp, cm.work_vector()):
            made = {}
            for builder in baseline_builders(config):
                try:
                    made[builder] = builder.plan(L[p], cm, config, validate=False)
                except PlanInfeasible:
                    made[builder] = None
            known.append(made)
        reused = layout_module.evaluate_layout(L, SHAPE, TOY, layout, ELASTIC, config, known=known)
        assert [p.report.predicted_step_ms for p in reused.plans] == [p.report.predicted_step_ms for p in fresh.plans]
        assert [p.report.candidates_ms for p in reused.plans] == [p.report.candidates_ms for p in fresh.plans]
        assert reused.detail == fresh.detail


def test_megatron_and_seq1f1b_search_tp_layouts_only(evaluate_layout):
    choice = search_layout(lengths(), SHAPE, TOY, MEGATRON, PlannerConfig(memory_budget_bytes=80.0 * GIB, max_seq_len=32768), exhaustive=True)
    assert all(r.layout.cp == 1 for r in choice.evaluated)


def test_flags():
    """A layout of the search is a ParallelDims: its name and pretrain_gpt.py's flags (a CP layout's with the one
    --cp-comm-type, a2a, and --elastic-pp; --sequence-parallel where it is on)."""
    assert ParallelDims(tp=2, pp=4, dp=1, cp=1).flags() == ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"]
    assert str(ParallelDims(tp=2, pp=1, dp=4, cp=4)) == "TP2xCP4xPP1xDP4"
    assert str(ParallelDims(tp=8, pp=1, dp=4, cp=1)) == "TP8xPP1xDP4"
    assert ParallelDims(tp=2, pp=1, dp=4, cp=4).flags() == ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                                          "--context-parallel-size", "4", "--cp-comm-type", "a2a", "--elastic-pp"]
    assert ParallelDims(tp=2, pp=1, dp=4, cp=4).world_size == 32
    assert ParallelDims(tp=2, sequence_parallel=True).flags()[-1] == "--sequence-parallel"


def preset_flags(shape: ModelShape) -> list[str]:
    """pretrain_gpt.py's flags of a LLaMA preset (SwiGLU, RMSNorm, no biases, RoPE, bf16) at a 128K context."""
    return ["--mock-data", "--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden), "--num-attention-heads",
            str(shape.num_heads), "--ffn-hidden-size", str(shape.ffn_hidden), "--swiglu", "--normalization", "RMSNorm",
            "--disable-bias-linear", "--position-embedding-type", "rope", "--seq-length", "131072",
            "--max-position-embeddings", "131072", "--bf16"]


def searchable_layouts() -> list[tuple[str, ModelShape, ParallelDims]]:
    """Every layout the search can return (it returns one of :func:`enumerate_layouts`'): each LLaMA preset on each
    cluster preset, whole (32 GPUs) and resized to one node and to 2, 4 GPUs; the toy model on the toy cluster."""
    out = [("toy", SHAPE, layout) for layout in enumerate_layouts(SHAPE, TOY)]
    for name, cluster in CLUSTERS.items():
        for world in (2, 4, 8, 32):
            for model, shape in MODEL_PRESETS.items():
                out += [(f"{model} {name} {world}", shape, layout) for layout in enumerate_layouts(shape, cluster_for_world(cluster, world))]
    return out


def parse_layout(shape: ModelShape, layout: ParallelDims) -> ParallelDims:
    """pretrain_gpt.py's argument parser on the model's flags and ``layout.flags()`` at the layout's world size: the
    parallel sizes it runs (a refused flag raises)."""
    world = layout.world_size
    shape_flags = preset_flags(shape) if shape is not SHAPE else [
        "--mock-data", "--num-layers", str(SHAPE.num_layers), "--hidden-size", str(SHAPE.hidden), "--num-attention-heads",
        str(SHAPE.num_heads), "--ffn-hidden-size", str(SHAPE.ffn_hidden), "--seq-length", "32768", "--max-position-embeddings", "32768", "--bf16"]
    return parse_config([*shape_flags, *layout.flags()], world_size=world).parallel.dims


SEARCHABLE = searchable_layouts()


def test_every_tp_layout_the_search_can_return_parses():
    """The layouts without context parallelism: ``pretrain_gpt.py``'s parser takes their flags as they are printed."""
    tp_only = [(what, shape, layout) for what, shape, layout in SEARCHABLE if layout.cp == 1]
    assert len(tp_only) > 100
    for what, shape, layout in tp_only:
        assert parse_layout(shape, layout) == layout, (what, str(layout))


def test_every_cp_layout_the_search_can_return_parses():
    """The layouts with context parallelism (TP x CP, with --elastic-pp): every one parses to its sizes."""
    with_cp = [(what, shape, layout) for what, shape, layout in SEARCHABLE if layout.cp > 1]
    assert {layout.cp for _, _, layout in with_cp} == {2, 4, 8}
    for what, shape, layout in with_cp:
        assert parse_layout(shape, layout) == layout, (what, str(layout))


def test_epp_plan_and_pretrain_gpt_print_the_best_flags(tmp_path, capsys, monkeypatch):
    """The printed answer of both CLIs (its form does not depend on the batch: 16 sequences for epp-plan, a global batch
    of 8 x 1024 tokens for pretrain_gpt.py keep the searches to seconds; the searches themselves are checked above)."""
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths()[:16])))
    epp_plan([str(path), "--epp-profile", "llama-7b", "--tp", "8", "--stages", "1", "--dp", "2", "--max-seq-len", "32768",
              "--epp-search-layout", "--epp-cluster", "h100-ib-gpu"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("layout search on h100-ib-gpu (2 x 8 GPUs): best ")
    assert out[-1].startswith("--tensor-model-parallel-size ")
    monkeypatch.setenv("WORLD_SIZE", "4")
    rc = pretrain_gpt(["--mock-data", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "1024",
                       "--global-batch-size", "8", "--bf16", "--epp-search-layout", "--epp-cluster", "a800-ib-node"])
    out = capsys.readouterr().out.strip().splitlines()
    flags = out[-1].split()
    assert rc == 0 and flags[:4:2] == ["--tensor-model-parallel-size", "--pipeline-model-parallel-size"]
    tp, pp = int(flags[1]), int(flags[3])
    cp = int(flags[flags.index("--context-parallel-size") + 1]) if "--context-parallel-size" in flags else 1
    assert 4 % (tp * cp * pp) == 0 and any(line.strip().startswith("TP1xCP2x") for line in out)  # CP layouts beside TP ones
    assert pretrain_gpt(["--mock-data", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
                         "--epp-cluster", "a800-ib-node"]) == 2
    assert "--epp-cluster applies only with --epp-search-layout" in capsys.readouterr().err


def driver_search(monkeypatch, *argv: str) -> tuple[int, dict]:
    """``pretrain_gpt.py --epp-search-layout`` on the mock documents (4 ranks) up to the search: its exit code and what
    it would search (the batch, the planner settings, the cluster); the search itself is checked above."""
    seen = {}

    def search(batch, shape, cluster, world, config):
        seen.update(batch=batch, config=config, cluster=cluster, world=world)
        raise ValueError("stop")

    monkeypatch.setattr(layout_search, "search_for_world", search)
    monkeypatch.setenv("WORLD_SIZE", "4")
    return pretrain_gpt([*DRIVER_MODEL, "--epp-search-layout", *argv]), seen


DRIVER_MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "1024",
                "--global-batch-size", "8"]


def test_driver_search_batch_is_the_planners_sample_of_the_train_documents(monkeypatch, capsys):
    rc, seen = driver_search(monkeypatch, "--seed", "5")
    assert rc == 2 and capsys.readouterr().err.strip() == "pretrain_gpt.py: error: --epp-search-layout: stop"
    args = parse_config([*DRIVER_MODEL, "--seed", "5"], world_size=4)
    sequences = np.asarray(elastic_documents(args, "train").lengths) - 1  # a document of n tokens: n - 1 positions
    assert seen["batch"].tolist() == select_batch(sequences[sequences > 0], 8, 5, 1024, truncate=True).tolist()
    assert seen["world"] == 4 and seen["cluster"] == "h100-ib-gpu"


@pytest.mark.parametrize("elastic", [[], ["--elastic-pp"]])
def test_driver_search_takes_the_planner_options_not_this_hosts_memory(monkeypatch, capsys, elastic):
    """With or without ``--elastic-pp``: the budget is the --epp-cluster preset's GPU memory (not this host's) unless
    --epp-memory-budget, the other --epp-* options as given, else the driver's defaults (the planner's time limit)."""
    rc, seen = driver_search(monkeypatch, *elastic, "--epp-cluster", "a800-ib-node")
    assert rc == 2 and seen["cluster"] == "a800-ib-node"
    assert seen["config"] == PlannerConfig(memory_budget_bytes=80.0 * GIB, max_seq_len=1024, profile=None, max_slices=EPP_DEFAULTS["epp_max_slices"],
                                           time_limit=PlannerConfig.time_limit)
    rc, seen = driver_search(monkeypatch, *elastic, "--epp-memory-budget", "40", "--epp-recompute", "greedy", "--epp-max-slices", "4",
                             "--epp-time-limit", "0.5")
    assert rc == 2 and seen["config"] == PlannerConfig(memory_budget_bytes=40.0 * GIB, max_seq_len=1024, profile=None, recompute="greedy",
                                                       max_slices=4, time_limit=0.5)
    capsys.readouterr()
    for flags, message in ((["--epp-profile", "llama-7b"], "--epp-profile does not apply with --epp-search-layout (it models"),
                           (["--epp-timeline", "t"], "--epp-timeline does not apply with --epp-search-layout (it prints"),
                           (["--epp-calibrate-interval", "5"], "--epp-calibrate-interval does not apply with --epp-search-layout"),
                           (["--epp-plan", "megatron"], "--epp-plan megatron: --epp-search-layout searches EPP's (elastic) layout"),
                           (["--epp-memory-budget", "0"], "--epp-memory-budget must be positive")):
        seen.clear()
        assert driver_search(monkeypatch, *elastic, *flags)[0] == 2 and not seen
        err = capsys.readouterr().err
        assert err.startswith(f"pretrain_gpt.py: error: {message}") and err.count("\n") == 1, err


def test_driver_search_refuses_too_long_documents_unless_truncated(monkeypatch, capsys):
    """As --elastic-pp training: a document longer than --seq-length is an error unless --epp-truncate-documents."""
    monkeypatch.setattr(layout_search, "elastic_documents", lambda args, split: SimpleNamespace(lengths=np.array([5001, 301, 1])))
    rc, seen = driver_search(monkeypatch)
    assert rc == 2 and not seen
    assert capsys.readouterr().err == ("pretrain_gpt.py: error: --epp-search-layout: --seq-length 1024: 4 document(s) longer than "
                                       "the cap (longest 5000 tokens); pass --epp-truncate-documents to cut them\n")
    rc, seen = driver_search(monkeypatch, "--epp-truncate-documents")
    assert sorted(set(seen["batch"].tolist())) == [300, 1024]


def test_longest_document_per_planned_layout(tmp_path, capsys, monkeypatch):
    """``--epp-longest-document``: every layout the search planned gets its longest single document without offload and
    with the ``--epp-offload`` mode given (the best layout's figures are :func:`longest_document`'s for it, with the
    chunked head and the tiled MLP the flags ask for); ``pretrain_gpt.py`` reports them the same way; without
    ``--epp-search-layout`` it is one line on either command line."""
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths()[:16])))
    epp_plan([str(path), "--epp-profile", "llama-7b", "--tp", "8", "--stages", "1", "--max-seq-len", "32768", "--epp-search-layout",
              "--epp-longest-document", "--epp-offload", "checkpoints", "--epp-loss-chunk-tokens", "4096", "--epp-mlp-chunk-tokens", "8192"])
    out = capsys.readouterr().out.strip().splitlines()
    planned = [line for line in out[1:-1] if "not planned" not in line]
    assert planned and all("longest document " in line and "with --epp-offload checkpoints" in line for line in planned)
    name = out[0].split(": best ")[1].split(",")[0]
    layout = next(d for d in enumerate_layouts(MODEL_PRESETS["llama-7b"], cluster_for_world(CLUSTERS["h100-ib-gpu"], 8), True, 16) if str(d) == name)
    shape = dataclasses.replace(MODEL_PRESETS["llama-7b"], loss_chunk_tokens=4096, mlp_chunk_tokens=8192)
    config = PlannerConfig(80 * GIB, 32768, profile="llama-7b", offload="checkpoints")
    found = layout_module.longest_documents(SimpleNamespace(evaluated=[SimpleNamespace(layout=layout)]), shape,
                                            cluster_for_world(CLUSTERS["h100-ib-gpu"], 8), config)[name]
    assert planned[0] == f"  {name}: {layout_module.describe_longest(found)}"
    assert found["checkpoints"].tokens > found["none"].tokens > 0
    monkeypatch.setattr(layout_search, "longest_documents", lambda choice, *rest: {str(r.layout): {} for r in choice.evaluated})
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert pretrain_gpt([*DRIVER_MODEL, "--epp-search-layout", "--epp-longest-document", "--epp-cluster", "a800-ib-node"]) == 0
    assert "longest document " in capsys.readouterr().out
    assert pretrain_gpt([*DRIVER_MODEL, "--epp-longest-document"]) == 2
    assert "--epp-longest-document applies only with --epp-search-layout" in capsys.readouterr().err
