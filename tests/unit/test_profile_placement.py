"""One function places a cost profile on a parallel layout (:func:`~megatron_epp.cost.placement.place_profile`): it
gives the numbers each former path gave (the layout search's stages, a profile used at another TP, the online
planner at CP, the training driver's TP then CP), and no other module re-labels a profile at a TP or CP size."""

from __future__ import annotations

import ast
from dataclasses import replace

import pytest

from megatron_epp.base.dims import ParallelDims
from megatron_epp.base.units import GIB
from megatron_epp.cost.activation_memory import MEASURED_MEMORY
from megatron_epp.cost.clusters import get_cluster, tp_profile
from megatron_epp.cost.placement import place_profile
from megatron_epp.cost.profile import Profile
from megatron_epp.cost.profile_lookup import PROFILE_DIR, load_profile
from megatron_epp.cost.shape import MODEL_PRESETS, TEST_MODEL
from megatron_epp.planner.config import PlannerConfig
from megatron_epp.planner.layout import layout_cost_model
from megatron_epp.planner.online import OnlinePlanner
from tests.paths import REPO


def numbers(p: Profile) -> tuple:
    return (p.tp, p.cp, p.fwd.a1, p.fwd.a2, p.fwd.b1, p.bwd.a2, p.head_fwd.a2, p.memory.act_token, p.memory.kv_token,
            p.memory.p2p_token)


# The old helpers' outputs at commit 8b38e1e (before place_profile), as numbers() reads them.
# cost.clusters.stage_profile(llama-7b, h100-ib-node, tp, cp, tp * cp * 4): the layout search's stage of tp x cp GPUs
STAGE = {
    (1, 1): (1, 1, 2.069732187973724e-08, 0.000818090623547246, 0.08, 0.001636181247094492, 0.0005298514401212733, 139776.0, 16384.0, 8192.0),
    (1, 2): (1, 2, 1.034866093986862e-08, 0.00042724975621806743, 0.092, 0.0008362950679916904, 0.00026492572006063666, 73984.0, 8192.0, 4096.0),
    (2, 1): (2, 1, 1.034866093986862e-08, 0.00042724975621806743, 0.08, 0.0008362950679916904, 0.00026492572006063666, 69888.0, 8192.0, 4096.0),
    (2, 2): (2, 2, 5.17433046993431e-09, 0.00022272710033125593, 0.092, 0.00042724975621806743, 0.00013246286003031833, 36992.0, 4096.0, 2048.0),
    (8, 1): (8, 1, 2.587165234967155e-09, 0.00013411910572118352, 0.08, 0.00023638043366458928, 6.623143001515917e-05, 17472.0, 2048.0, 1024.0),
}
# cost.profile_lookup.profile_at_tp(the shipped H100 profile with a measured memory block, tp)
AT_TP = {
    2: (2, 1, 4.151418875339305e-09, 3.6822860513545e-05, 1.8375158945995391, 6.456477769583109e-05, 1.6241284152983207e-06, 19148.800000000003, 2048.0, 2048.0),
    8: (8, 1, 4.151418875339305e-09, 3.6822860513545e-05, 1.8375158945995391, 6.456477769583109e-05, 1.6241284152983207e-06, 4787.200000000001, 512.0, 2048.0),
}
# OnlinePlanner(test model, ParallelDims(tp, pp=2, cp, sequence_parallel=sp), the test-model profile at tp).cost_model.profile
# (OnlinePlanner.__init__'s cost.clusters.cp_profile on the default network; at tp 2 after profile_at_tp, as the
# training driver resolves it)
ONLINE = {
    (1, 1, False): (1, 1, 2.231311127113592e-06, 0.0029920738704423346, 0.9443148582473028, 0.004049820038921436, 0.0008413383067653184, 4896.0, 512.0, 256.0),
    (1, 2, False): (1, 2, 1.115655563556796e-06, 0.0016240369352211674, 1.1443148582473028, 0.0021529100194607183, 0.0004206691533826592, 2192.0, 256.0, 128.0),
    (2, 1, False): (2, 1, 2.231311127113592e-06, 0.0029920738704423346, 0.9443148582473028, 0.004049820038921436, 0.0008413383067653184, 2968.0, 256.0, 256.0),
    (2, 1, True): (2, 1, 2.231311127113592e-06, 0.0029920738704423346, 0.9443148582473028, 0.004049820038921436, 0.0008413383067653184, 2448.0, 256.0, 256.0),
    (2, 2, False): (2, 2, 1.115655563556796e-06, 0.0015600369352211673, 1.1443148582473028, 0.002088910019460718, 0.0004206691533826592, 1356.0, 128.0, 128.0),
    (2, 2, True): (2, 2, 1.115655563556796e-06, 0.0015600369352211673, 1.1443148582473028, 0.002088910019460718, 0.0004206691533826592, 1096.0, 128.0, 128.0),
}


@pytest.mark.parametrize(("tp", "cp"), sorted(STAGE))
def test_a_layout_search_stage_as_before(tp, cp):
    shape, cluster = MODEL_PRESETS["llama-7b"], get_cluster("h100-ib-node")
    dims = ParallelDims.for_world(cluster.world_size, tp=tp, pp=4, cp=cp)
    placed = place_profile(tp_profile(shape, cluster, tp), dims, cluster.network(tp * cp * 4))
    assert numbers(placed) == pytest.approx(STAGE[tp, cp], rel=1e-12)
    assert numbers(layout_cost_model(shape, cluster, dims).profile) == pytest.approx(STAGE[tp, cp], rel=1e-12)


@pytest.mark.parametrize("tp", sorted(AT_TP))
def test_a_measured_profile_at_another_tp_as_before(tp):
    shipped = Profile.load(PROFILE_DIR / "gpu-h1024_h100_tp1.json")
    measured = replace(shipped, memory=replace(shipped.memory, derive=MEASURED_MEMORY, basis="megatron-gpu",
                                               act_token=1.1 * shipped.memory.act_token))
    assert numbers(place_profile(measured, ParallelDims(tp=tp))) == pytest.approx(AT_TP[tp], rel=1e-12)


@pytest.mark.parametrize(("tp", "cp", "sp"), sorted(ONLINE))
def test_the_online_planners_profile_as_before(tp, cp, sp):
    config = PlannerConfig(memory_budget_bytes=0.05 * GIB, max_seq_len=1024, max_slices=8)
    resolved = place_profile(load_profile("test-model"), ParallelDims(tp=tp))  # as the training driver resolves it
    planner = OnlinePlanner(config, TEST_MODEL, ParallelDims(tp=tp, pp=2, cp=cp, sequence_parallel=sp), resolved)
    assert numbers(planner.cost_model.profile) == pytest.approx(ONLINE[tp, cp, sp], rel=1e-12)


def test_cp_needs_a_profile_at_cp_1_and_heads_it_divides():
    profile = load_profile("test-model")
    with pytest.raises(ValueError, match=r"^--context-parallel-size 3: must divide the 4 attention heads"):
        place_profile(profile, ParallelDims(cp=3))
    with pytest.raises(ValueError, match="already at context-parallel size 2"):
        place_profile(place_profile(profile, ParallelDims(cp=2)), ParallelDims(cp=2))
    with pytest.raises(ValueError, match=r"cannot be re-derived for TP=2 \(no memory 'derive'\)"):
        place_profile(replace(profile, memory=replace(profile.memory, derive="")), ParallelDims(tp=2))


def relabels_tp_or_cp(tree: ast.AST) -> list[int]:
    """The lines of ``replace(x, ..., tp=..|cp=..)`` calls (dataclasses' replace) in ``tree`` on anything but a layout
    (``...dims``): a profile put at another tensor- or context-parallel size."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "replace"
                and node.args and not ast.unparse(node.args[0]).endswith("dims")
                and {k.arg for k in node.keywords} & {"tp", "cp"}):
            lines.append(node.lineno)
    return lines


def test_only_the_placement_module_fits_a_profile_to_tp_or_cp():
    """A second fit of a profile to a layout (a profile re-labelled at a TP or CP size beside its coefficients) is
    in cost/placement.py or nowhere: every caller goes through place_profile."""
    placement = REPO / "megatron_epp" / "cost" / "placement.py"
    sources = sorted([*(REPO / "megatron_epp").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")])
    found = {str(path.relative_to(REPO)): lines for path in sources
             if path != placement and (lines := relabels_tp_or_cp(ast.parse(path.read_text())))}
    assert found == {}
    assert len(relabels_tp_or_cp(ast.parse(placement.read_text()))) == 2  # at tp, at cp: the check sees them
