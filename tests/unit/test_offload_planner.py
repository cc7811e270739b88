"""Activation offload in the planner (issue 41; docs/planner.md, "Activation offload"): the integer program's choice,
the memory walk with checkpoints and K/V buffers on the host, the copy time charged beyond the overlap, bad input in
one line, and every plan without offload as it was."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_epp.base.dims import ParallelDims
from megatron_epp.base.units import GIB
from megatron_epp.config.errors import ArgumentError
from megatron_epp.config.parser import parse_config
from megatron_epp.cost.clusters import get_cluster
from megatron_epp.cost.features import chunk_features
from megatron_epp.cost.host import HostLink, host_memory_bytes
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.profile_lookup import load_profile
from megatron_epp.cost.shape import MODEL_PRESETS
from megatron_epp.plan import Plan, PlanError
from megatron_epp.planner.builders import ELASTIC
from megatron_epp.planner.cli import main
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.planner.layout import layout_cost_model
from megatron_epp.simulator.memory import stage_memory
from megatron_epp.simulator.offload import exposed_ms

SHAPE = MODEL_PRESETS["llama-7b"]
NODE = get_cluster("h100-ib-gpu").with_nodes(1)
ONE_M = 1 << 20


@pytest.fixture(scope="module")
def node_model() -> CostModel:
    """llama-7b at TP 8 on one 8 x H100 node (PP 1), with the preset's host link."""
    return layout_cost_model(SHAPE, NODE, ParallelDims.for_world(8, tp=8, pp=1, cp=1))


def plan(cm: CostModel, n: int, **kw):
    return ELASTIC.plan([n], cm, PlannerConfig(80 * GIB, n, **kw))


def test_offload_is_chosen_where_it_saves_recompute_and_the_host_has_room(node_model):
    none, off = plan(node_model, ONE_M), plan(node_model, ONE_M, offload="checkpoints")
    pipe = off.plan.pipelines[0]
    assert none.plan.recomputed_layers() == 32 and not none.plan.offloads()
    assert sum(pipe.offload[0]) > 0 and off.plan.recomputed_layers() < 32  # a layer kept: its checkpoints on the host
    assert off.report.predicted_step_ms < none.report.predicted_step_ms
    assert off.report.host_memory_bytes[0] > 0 and off.report.copy_ms == 0.0  # 1M tokens of compute hide the copies


def test_offload_is_never_chosen_without_host_memory(node_model):
    none = plan(node_model, ONE_M)
    zero = plan(node_model, ONE_M, offload="auto", host_memory_budget_bytes=0.0)
    assert not zero.plan.offloads() and zero.plan.to_json() == none.plan.to_json()
    assert zero.report.predicted_step_ms == none.report.predicted_step_ms


def test_offload_lengthens_the_longest_document(node_model):
    with pytest.raises(Exception, match="fits 80.0 GB"):
        plan(node_model, 2 * ONE_M)
    two = plan(node_model, 2 * ONE_M, offload="checkpoints")
    assert max(two.report.peak_memory_bytes) <= 80 * GIB
    assert max(two.report.host_memory_bytes) <= NODE.host.default_budget_bytes()


def test_the_walk_moves_exactly_the_offloaded_bytes_to_the_host(node_model):
    step = plan(node_model, ONE_M, offload="checkpoints")
    pipe = step.plan.pipelines[0]
    costs = node_model.costs(chunk_features(pipe.chunks))
    sm = stage_memory(pipe, 0, 1, costs, 32, 0.0)
    c, o = np.array(pipe.recompute[0]), np.array(pipe.offload[0])
    moved = sm.rows(c) - sm.rows(c, o)
    resident = sm.resident.toarray()[:, 0] > 0
    own = np.zeros(len(moved), dtype=bool)
    own[sm.own_row[0]] = True
    offloaded = o[0] * costs.ckpt_layer[0]
    assert np.allclose(moved[resident & ~own], offloaded)  # the device holds exactly the offloaded bytes less
    # but at its first recompute the fetched inputs are back: one ahead of a kept layer, or at o = c >= 2 the recomputed
    # layer's own and the next one's (the executor's order, measured in tests/integration/test_offload_executor.py)
    slots = 2 if o[0] == c[0] >= 2 else 1
    assert np.allclose(moved[own], offloaded - slots * costs.ckpt_layer[0])
    assert np.allclose(moved[~resident], 0.0)
    assert np.allclose(sm.host_rows(o)[resident], offloaded) and np.allclose(sm.host_rows(o)[~resident], 0.0)


def test_kv_buffers_on_the_host_leave_a_window_on_the_device():
    cm = layout_cost_model(SHAPE, get_cluster("h100-ib-gpu").with_nodes(4), ParallelDims.for_world(32, tp=8, pp=4, cp=1))
    step = ELASTIC.plan([2 * ONE_M], cm, PlannerConfig(80 * GIB, 2 * ONE_M, offload="auto"))
    pipe = step.plan.pipelines[0]
    assert pipe.kv_host == [0]
    costs = cm.costs(chunk_features(pipe.chunks))
    sm = stage_memory(pipe, 0, 4, costs, 8, 0.0)
    buffer = 8 * costs.kv_layer.sum() * (1 + costs.kv_grad)  # every layer's K/V and accumulators of the stage
    assert sm.host_base.max() == pytest.approx(buffer)
    device = replace(pipe, kv_host=[])
    assert (stage_memory(device, 0, 4, costs, 8, 0.0).base.max() - sm.base.max()) > 0.9 * 8 * costs.kv_layer.sum()
    assert Plan.from_json(step.plan.to_json()).pipelines[0].kv_host == [0]


def test_copy_time_is_charged_only_beyond_the_overlap(node_model):
    step = plan(node_model, ONE_M, offload="checkpoints")
    pipe = step.plan.pipelines[0]
    costs = node_model.costs(chunk_features(pipe.chunks))
    moved = pipe.offload[0][0] * costs.ckpt_layer[0]
    fast = HostLink(25.0, 25.0, 2048.0, 8)
    assert not exposed_ms(pipe, costs, node_model.layers, fast)[0].any()  # hidden behind the forward and backward
    slow = HostLink(1e-3, 1e-3, 2048.0, 8)  # 1 MB/s
    fwd, bwd = exposed_ms(pipe, costs, node_model.layers, slow)
    assert fwd[0, 0] == pytest.approx(moved / 1e3 - costs.fwd[0, 0])
    rc = pipe.recompute[0][0] * costs.rc_layer[0]
    assert bwd[0, 0] == pytest.approx(moved / 1e3 - costs.bwd[0, 0] - rc)
    # at that bandwidth the program does not offload: recompute is cheaper than the copy it would wait for
    slow_model = CostModel(node_model.profile, 1, network=node_model.network, host=replace(NODE.host, d2h_gbps=1e-3, h2d_gbps=1e-3))
    assert not plan(slow_model, ONE_M // 2, offload="checkpoints").plan.offloads()


def test_an_offload_plan_validates_its_counts(node_model):
    p = plan(node_model, ONE_M, offload="checkpoints").plan
    p.pipelines[0].offload[0][0] = p.pipelines[0].recompute[0][0] + 1
    with pytest.raises(PlanError, match="offload"):
        p.validate()


@pytest.fixture
def doc_file(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text(f"{4 * ONE_M}\n")
    return path


def one_line_error(capsys, argv, code):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == code and len(err) == 1, err
    return err[0]


def test_a_host_budget_larger_than_the_host_is_one_line(doc_file, capsys):
    line = one_line_error(capsys, [str(doc_file), "--epp-profile", "llama-7b", "--stages", "1", "--max-seq-len", str(4 * ONE_M),
                                   "--baselines", "", "--epp-offload", "auto", "--epp-host-memory-budget", "300"], 2)
    assert "--epp-host-memory-budget 300 GB per GPU x 8 GPUs per node = 2400 GB: more than the node's 2048 GB" in line


def test_a_plan_needing_more_host_memory_than_allowed_is_one_line(doc_file, capsys):
    line = one_line_error(capsys, [str(doc_file), "--epp-profile", "llama-7b", "--stages", "1", "--max-seq-len", str(4 * ONE_M),
                                   "--baselines", "", "--epp-offload", "auto", "--epp-host-memory-budget", "10"], 1)
    assert "of host memory per GPU" in line and "more than --epp-host-memory-budget 10 GB" in line


def test_epp_plan_prints_the_host_memory_and_the_step(tmp_path, capsys):
    path = tmp_path / "doc.txt"
    path.write_text(f"{2 * ONE_M}\n")
    main([str(path), "--epp-profile", "llama-7b", "--stages", "1", "--max-seq-len", str(2 * ONE_M), "--baselines", "",
          "--epp-offload", "checkpoints", "--json"])
    out = capsys.readouterr().out
    assert "offload checkpoints: host memory GB per GPU per stage: 64.0 (budget 192)" in out
    assert '"host_memory_gb":[64.0]' in out


def test_training_plans_with_offload_on_this_nodes_host_link():
    """pretrain_gpt takes --epp-offload and --epp-host-memory-budget; the online planner's cost model then has this
    node's host memory (shared by its local ranks) and the stated copy bandwidth."""
    from megatron_epp.training.planning import online_planner

    cfg = parse_config(["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2",
                        "--elastic-pp", "--epp-offload", "checkpoints", "--epp-host-memory-budget", "0.5"], world_size=1)
    assert cfg.epp.planner.offload == "checkpoints" and cfg.epp.planner.host_memory_budget_bytes == 0.5 * GIB
    host = online_planner(cfg).cost_model.host
    assert host is not None and host.host_bytes == host_memory_bytes() and host.gpus_per_node == 1
    plain = parse_config(["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--elastic-pp"],
                         world_size=1)
    assert online_planner(plain).cost_model.host is None  # without offload, the cost model as before


def test_training_refuses_a_host_budget_over_the_host_in_one_line():
    from megatron_epp.config import validation

    with pytest.raises(ArgumentError, match="more than the node's .* GB of host memory"):
        parse_config(["--mock-data", "--num-layers", "4", "--elastic-pp", "--epp-offload", "checkpoints",
                      "--epp-host-memory-budget", str(2 * host_memory_bytes() / GIB)], world_size=1)
    with pytest.raises(ArgumentError, match=r"--epp-offload auto on cuda: K/V buffers on the host need the block attention .* "
                                            r"\(dtype float32, .* takes float16/bfloat16\): --epp-offload checkpoints$"):
        validation.check_offload(PlannerConfig(80 * GIB, ONE_M, offload="auto"), "cuda")
    # on CPU training takes auto (the executor runs K/V buffers on the host)
    assert parse_config(["--mock-data", "--num-layers", "4", "--elastic-pp", "--epp-offload", "auto"], world_size=1)
    with pytest.raises(ArgumentError, match="applies only with --epp-offload"):
        parse_config(["--mock-data", "--num-layers", "4", "--elastic-pp", "--epp-host-memory-budget", "1"], world_size=1)


def test_training_takes_offload_auto_on_cuda_in_half_precision_where_the_block_kernel_runs(monkeypatch):
    from megatron_epp.config import validation
    from megatron_epp.executor import kernels

    monkeypatch.setattr(kernels, "load_block_flash", lambda: (kernels.BlockFlashKernel(kernels.FlashOps(print, print), min_capability=None), ""))
    monkeypatch.setattr(validation.torch, "empty", lambda *args, **kwargs: None)  # pinned memory taken (no CUDA here)
    validation.check_offload(PlannerConfig(80 * GIB, ONE_M, offload="auto"), "cuda", torch.bfloat16)
    with pytest.raises(ArgumentError, match=r"auto on cuda: .* \(dtype float32, .*\): --epp-offload checkpoints$"):
        validation.check_offload(PlannerConfig(80 * GIB, ONE_M, offload="auto"), "cuda", torch.float32)
    monkeypatch.setattr(kernels, "load_block_flash", lambda: (None, "torch 9.9 has no aten flash ops"))
    with pytest.raises(ArgumentError, match=r"auto on cuda: .* \(torch 9.9 has no aten flash ops\): --epp-offload checkpoints$"):
        validation.check_offload(PlannerConfig(80 * GIB, ONE_M, offload="auto"), "cuda", torch.bfloat16)


def test_training_refuses_offload_without_pinned_memory_in_one_line(monkeypatch):
    from megatron_epp.config import validation

    def no_pinning(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory\nwhile pinning")

    monkeypatch.setattr(validation.torch, "empty", no_pinning)
    with pytest.raises(ArgumentError, match="error: --epp-offload checkpoints: pinned host memory cannot be allocated here "
                                            r"\(CUDA error: out of memory while pinning\)$"):
        validation.check_offload(PlannerConfig(GIB, 64, offload="checkpoints"), "cuda")
    validation.check_offload(PlannerConfig(GIB, 64, offload="checkpoints"), "cpu")  # no pinning on CPU


def test_plans_without_offload_are_as_before_offload():
    """Predicted steps and plans pinned from the commit before offload (ffcc474; the second as of f756551), offload off."""
    cm = layout_cost_model(SHAPE, NODE, ParallelDims.for_world(8, tp=8, pp=1, cp=1))
    one = ELASTIC.plan([ONE_M], cm, PlannerConfig(80 * GIB, ONE_M))
    assert one.report.predicted_step_ms == pytest.approx(426775.807347739, rel=1e-12)
    assert hashlib.sha256(one.plan.to_json().encode()).hexdigest()[:16] == "c7df97c683098a60"
    cm = layout_cost_model(SHAPE, get_cluster("h100-ib-gpu").with_nodes(4), ParallelDims.for_world(32, tp=8, pp=4, cp=1))
    mixed = ELASTIC.plan([131072, 65536, 30000, 20000, 9000, 4000, 4000, 2000, 1000, 500] * 2, cm, PlannerConfig(24 * GIB, 131072))
    # 5848.1 ms with 20 recomputed layers at ffcc474; f756551 weighs the no-recompute finalists without recompute too
    # (regrouped) besides with it, which finds this faster plan (3 pipelines, 10 layers)
    assert mixed.report.predicted_step_ms == pytest.approx(5715.082758905722, rel=1e-12) and mixed.plan.recomputed_layers() == 10
    small = ELASTIC.plan([3000, 1200, 800, 500, 300, 200, 150, 90, 60, 40, 20, 10] * 2, CostModel(load_profile("test-model", 1), 2),
                         PlannerConfig(0.08 * GIB, 4096))
    assert small.report.predicted_step_ms == pytest.approx(1338.2216357752388, rel=1e-12)
    assert "offload" not in one.plan.to_json() and one.report.host_memory_bytes is None


def test_the_copy_bandwidth_is_measured_on_cpu_within_its_time_box():
    """The start-up measurement runs on CPU (host to host, the CPU executor's copies): positive finite figures, the
    median of at most its repeats; a time box of 0 s stops it after one timed repeat, and the ranks' agreement
    (``go_on``) ends it when any rank says stop. No figure is compared with a speed: the host's load is not ours."""
    import torch

    from megatron_epp.measure.host_bandwidth import REPEATS, measure_copy_bandwidth

    full = measure_copy_bandwidth(torch.device("cpu"), nbytes=1 << 20)
    assert np.isfinite([full.d2h_bytes_per_ms, full.h2d_bytes_per_ms]).all() and min(full.d2h_bytes_per_ms, full.h2d_bytes_per_ms) > 0
    assert 1 <= full.repeats <= REPEATS and full.nbytes == 1 << 20 and full.device_type == "cpu" and full.ranks == 1
    assert measure_copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, time_box_s=0.0).repeats == 1
    asked = []
    two = measure_copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, time_box_s=60.0,
                                 go_on=lambda more: asked.append(more) or len(asked) < 3)
    assert two.repeats == 2 and asked == [True, True, True]  # the first call before the first repeat, then after each


def fake_bandwidth(d2h_bytes_per_ms: float, h2d_bytes_per_ms: float):
    from megatron_epp.measure.host_bandwidth import CopyBandwidth

    return CopyBandwidth(d2h_bytes_per_ms, h2d_bytes_per_ms, 1 << 20, 3, "cpu", 2)


OFFLOAD_RUN = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--elastic-pp"]


def started(monkeypatch, flags: list[str], measured=None):
    """``ElasticSteps`` of ``OFFLOAD_RUN + flags`` started on CPU, the start-up measurement replaced by ``measured``
    (None: one that fails the test); the calls it got."""
    import types

    import torch

    from megatron_epp.training import planning
    from megatron_epp.training import step as step_module

    calls = []

    def measure(device):
        calls.append(device)
        assert measured is not None, "the copy bandwidth was measured without --epp-offload"
        return measured

    monkeypatch.setattr(planning, "measure_node_copy_bandwidth", measure)
    steps = step_module.ElasticSteps(parse_config([*OFFLOAD_RUN, *flags], world_size=1))
    assert not calls  # nothing measured before start-up
    steps.start(types.SimpleNamespace(device=torch.device("cpu")))
    return steps, calls


def test_training_plans_offload_on_the_measured_host_link(monkeypatch):
    """--epp-offload checkpoints: the copy bandwidth is measured once at start-up, the planner's cost model (and the
    calibrated ones made from it) carries exactly the measured figures with this node's host memory, and the
    start-up line says them."""
    from megatron_epp.cost.host import measured_host_link

    steps, calls = started(monkeypatch, ["--epp-offload", "checkpoints", "--epp-host-memory-budget", "0.5"],
                           fake_bandwidth(7.25e6, 3.5e6))
    assert len(calls) == 1 and calls[0].type == "cpu"
    host = steps.planner.cost_model.host
    assert host == measured_host_link(7.25e6, 3.5e6, 1) and (host.d2h_gbps, host.h2d_gbps) == (7.25, 3.5)
    assert host.host_bytes == host_memory_bytes() and "measured" in host.description
    assert steps.planner.raw_model.host is host and steps.planner.next_step_model.host is host
    from megatron_epp.cost.profile import StageOverhead

    assert steps.planner.cost_model.calibrated(1.5, StageOverhead(0.1, 0.2)).host is host  # a refit keeps the link
    line = [s for s in steps.startup_lines() if s.startswith("host link:")]
    assert line == [f"host link: measured 7.2 GB/s out, 3.5 back (host to host into the CPU executor's pool and back, "
                    f"one after the other, 1 local rank; median of 3 x 1 MiB, the minimum over 2 ranks), host memory "
                    f"{host_memory_bytes() / GIB:.1f} GB, budget 0.5 GB per rank (--epp-host-memory-budget)"]


def test_the_measured_bandwidth_is_what_offload_plans_are_timed_on(monkeypatch):
    """The same plan (every layer recomputed, every checkpoint offloaded) timed on the planner's cost model with a fake
    measurement and one a million times slower: the copies the fast link hides are exposed on the slow one, exactly
    as the measured link times them."""
    flags = ["--epp-offload", "checkpoints", "--seq-length", "256"]
    fast, _ = started(monkeypatch, flags, fake_bandwidth(20e6, 20e6))
    slow, _ = started(monkeypatch, flags, fake_bandwidth(20.0, 20.0))
    pipe = fast.planner([256, 256]).plan.pipelines[0]
    layers = fast.planner.cost_model.layers
    full = [[int(layers[s])] * len(pipe.chunks) for s in range(len(layers))]
    pipe = replace(pipe, recompute=full, offload=full)
    exposed = {}
    for name, steps in (("fast", fast), ("slow", slow)):
        model = steps.planner.cost_model
        costs = model.costs(chunk_features(pipe.chunks))
        exposed[name] = sum(float(np.sum(part)) for part in exposed_ms(pipe, costs, model.layers, model.host))
        moved = full[0][0] * costs.ckpt_layer[0]  # the first chunk's checkpoints, out in its forward
        assert exposed_ms(pipe, costs, model.layers, model.host)[0][0, 0] == pytest.approx(
            max(0.0, moved / model.host.d2h_bytes_per_ms - costs.fwd[0, 0]))
    assert exposed["slow"] > exposed["fast"] >= 0.0


def test_without_offload_nothing_is_measured(monkeypatch):
    """Without --epp-offload the start-up measures nothing, says no host link, and the cost model has none."""
    steps, calls = started(monkeypatch, [])
    assert calls == [] and steps.planner.cost_model.host is None
    assert not any(s.startswith("host link") for s in steps.startup_lines())


def test_the_chunking_proxy_charges_the_kv_copies_the_simulator_charges():
    """Under ``auto``, a chunking with its split sequences' K/V buffers on the host is scored with the copies of those
    buffers that no compute hides: per stage the figure the simulator charges the plan with its K/V on the host and
    nothing else offloaded. Where the exact walk puts the K/V on the host, the chunkings are searched again so
    charged: on a slow host link (2 GB/s) the plan's slices are longer than without the charge, and its predicted step
    and exposed copy time shorter."""
    from megatron_epp.planner import epp
    from megatron_epp.simulator.memory import kv_host_units
    from megatron_epp.simulator.offload import kv_host_copy_ms

    cluster = get_cluster("h100-ib-gpu").with_nodes(4)
    cm = layout_cost_model(SHAPE, cluster, ParallelDims.for_world(32, tp=8, pp=4, cp=1))
    slow = CostModel(cm.profile, 4, network=cm.network, host=replace(cluster.host, d2h_gbps=2.0, h2d_gbps=2.0))
    config = PlannerConfig(80 * GIB, 2 * ONE_M, offload="auto")
    charged = ELASTIC.plan([2 * ONE_M], slow, config)
    original = epp.kv_host_copy_ms
    try:
        epp.kv_host_copy_ms = lambda units, costs, layers, host: np.zeros(len(layers))
        blind = ELASTIC.plan([2 * ONE_M], slow, config)
    finally:
        epp.kv_host_copy_ms = original
    chunks = [len(list(step.plan.chunks())) for step in (charged, blind)]
    assert charged.plan.pipelines[0].kv_host == blind.plan.pipelines[0].kv_host == [0] and chunks[0] < chunks[1]
    assert charged.report.predicted_step_ms < blind.report.predicted_step_ms and charged.report.copy_ms < blind.report.copy_ms
    pipe = blind.plan.pipelines[0]
    pipe = replace(pipe, offload=[], recompute=[[0] * len(pipe.chunks)] * 4)
    costs = slow.costs(chunk_features(pipe.chunks))
    fwd, bwd = exposed_ms(pipe, costs, slow.layers, slow.host)
    assert (fwd + bwd).sum() > 0
    assert np.allclose((fwd + bwd).sum(axis=1), kv_host_copy_ms(kv_host_units(pipe), costs, slow.layers, slow.host))


def test_auto_never_fits_less_than_checkpoints():
    """``auto`` plans ``checkpoints``'s plan too and keeps the faster: where every chunking of its own search puts K/V
    buffers on the host that the host budget cannot hold, the whole document as one fully recomputed chunk with its
    checkpoints on the host still fits (6.55M tokens on 32 GPUs with the chunked head and the tiled MLP; before, the
    longest document under ``auto`` was 6.29M where ``checkpoints`` reached 7.93M); and where both fit, ``auto``'s plan is
    never predicted slower than ``checkpoints``'s."""
    shape = replace(SHAPE, loss_chunk_tokens=4096, mlp_chunk_tokens=8192)
    cm = layout_cost_model(shape, get_cluster("h100-ib-gpu").with_nodes(4), ParallelDims.for_world(32, tp=8, pp=4, cp=1))
    n = 6_553_600
    auto = ELASTIC.plan([n], cm, PlannerConfig(80 * GIB, n, offload="auto"))
    ckpt = ELASTIC.plan([n], cm, PlannerConfig(80 * GIB, n, offload="checkpoints"))
    assert auto.report.predicted_step_ms == ckpt.report.predicted_step_ms and not auto.plan.pipelines[0].kv_host
    two = [ELASTIC.plan([2 * ONE_M], cm, PlannerConfig(80 * GIB, 2 * ONE_M, offload=mode)) for mode in ("auto", "checkpoints")]
    assert two[0].report.predicted_step_ms <= two[1].report.predicted_step_ms
