"""Context parallelism (Ulysses all-to-all, ``--context-parallel-size``) in the cost model: a CP rank's activation
memory, the all-to-all time on the cluster presets' links, model states as megatron-core holds them, the padding;
nothing changes at cp 1."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_epp.base.dims import ParallelDims
from megatron_epp.cost.clusters import CLUSTERS, Cluster, get_cluster, tp_profile
from megatron_epp.cost.features import sequence_features
from megatron_epp.cost.model import CostModel
from megatron_epp.cost.network import Network
from megatron_epp.cost.activation_memory import MEASURED_MEMORY, gpu_activation_memory, saved_tensor_memory, shape_memory
from megatron_epp.cost.analytic import analytic_profile
from megatron_epp.cost.placement import place_profile
from megatron_epp.cost.profile import Profile
from megatron_epp.cost.profile_lookup import load_profile
from megatron_epp.cost.shape import MODEL_PRESETS, TEST_MODEL, ModelShape

LLAMA_GQA = ModelShape("gqa", 4, 4096, 32, 14336, 32000, num_kv_heads=8, dtype="bfloat16", normalization="RMSNorm", bias=False)


def stage(shape: ModelShape, cluster: Cluster, tp: int, cp: int, span: int) -> Profile:
    """A stage of ``tp x cp`` GPUs of ``cluster`` in a pipeline of ``span`` GPUs, as the layout search places it."""
    return place_profile(tp_profile(shape, cluster, tp), ParallelDims(tp=tp, cp=cp), cluster.network(span))


def test_cp_1_is_the_profile_itself():
    net = get_cluster("a800-ib-node").network(8)
    for profile in (analytic_profile(MODEL_PRESETS["llama-7b"], 4), load_profile("test-model")):
        assert place_profile(profile, ParallelDims(tp=profile.tp), net) is profile
        assert profile.cp == 1


def test_saved_tensor_share_of_a_cp_rank_counted_by_hand():
    """fp32 GPT-style test model (h 64, 4 heads, ffn 256, LayerNorm, RoPE) at tp 1, cp 2, K/V heads split: per token
    of the chunk, tensor by tensor (module docstring of saved_tensor_memory)."""
    b, h, f, cp = 4.0, 64, 256, 2
    got = saved_tensor_memory(TEST_MODEL, 1, cp=cp)
    norm = (b * h + 2 * b) / cp
    # core attention over every token at heads / 2: q, k, v (the all-to-alls' outputs), its output, logsumexp (fp32)
    attention = b * h / cp + 2 * b * h / cp + b * h / cp + 4 * 4 / cp
    outside = 2 * norm + 2 * b * h / cp + b * h / cp + 2 * b * f / cp  # norms, QKV and fc1 inputs, proj input, GELU + fc2
    assert got["act_token"] == pytest.approx(outside + attention)
    assert got["kv_token"] == pytest.approx(2 * b * h / cp) and got["lone_slice_token"] == pytest.approx(2 * b * h / cp)
    assert got["ckpt_token"] == pytest.approx(b * h / cp)
    assert got["logits_token"] == pytest.approx(norm + (b * h + 4 * TEST_MODEL.vocab + 13) / cp)
    assert got["embed_token"] == pytest.approx(8.0 / cp)


@pytest.mark.parametrize("count", [saved_tensor_memory, gpu_activation_memory])
def test_a_cp_rank_holds_about_one_nth(count):
    shape = replace(LLAMA_GQA, num_kv_heads=32)  # K/V heads split at every cp
    one = count(shape, 2)
    for cp in (2, 4, 8):
        share = count(shape, 2, cp=cp)
        for key in ("ckpt_token", "logits_token", "kv_token"):
            assert share[key] == pytest.approx(one[key] / cp), (cp, key)
        # about 1/cp: the attention output held twice (before and after the all-to-all back); on CPU neither the RoPE
        # outputs nor the QKV output are saved (the all-to-alls' inputs), the all-to-alls' outputs are
        assert 0.8 * one["act_token"] / cp < share["act_token"] < 1.15 * one["act_token"] / cp, cp


@pytest.mark.parametrize("count", [saved_tensor_memory, gpu_activation_memory])
def test_kv_heads_replicated_when_cp_does_not_divide_them(count):
    """GQA with 8 K/V heads: at cp 8 each rank holds one K/V head's share; at cp 16 every rank holds all 8."""
    one, eight, sixteen = count(LLAMA_GQA, 1), count(LLAMA_GQA, 1, cp=8), count(LLAMA_GQA, 1, cp=16)
    assert eight["kv_token"] == pytest.approx(one["kv_token"] / 8)
    assert sixteen["kv_token"] == pytest.approx(one["kv_token"])  # replicated: the buffer holds every K/V head
    assert sixteen["lone_slice_token"] == pytest.approx(sixteen["kv_token"])  # a lone slice's own K and V, all heads
    assert sixteen["act_token"] > sixteen["kv_token"]


def test_cp_must_divide_the_heads_of_a_tp_rank():
    with pytest.raises(ValueError, match=r"^--context-parallel-size 4: must divide the 13 attention heads per tensor-parallel rank"):
        saved_tensor_memory(MODEL_PRESETS["llama-30b"], 4, cp=4)
    with pytest.raises(ValueError, match=r"^--context-parallel-size 3: must divide the 8 attention heads"):
        place_profile(analytic_profile(MODEL_PRESETS["llama-7b"], 4), ParallelDims(tp=4, cp=3), get_cluster("h100-ib-gpu").network(8))


def test_all_to_all_time_on_the_presets_links():
    """4 all-to-alls per layer forward (q, k, v, output) and 4 backward: per token of the chunk a GPU holds
    ``2 (2 q + 2 h_kv) / tp / cp`` bf16 bytes of them and sends ``(cp-1)/cp`` over NVLink; the compute is divided by cp."""
    shape = MODEL_PRESETS["llama-7b"]
    for name, cluster in CLUSTERS.items():
        base = tp_profile(shape, cluster, 2)
        got = stage(shape, cluster, 2, 4, 8)
        bytes_token = 2 * (2 * 4096 / 2 / 4 + 2 * 4096 / 2 / 4)
        a2a = bytes_token * 3 / 4 / (cluster.nvlink_gbps * 1e9) * 1e3  # ms per token
        for t, b in ((got.fwd, base.fwd), (got.bwd, base.bwd), (got.recompute, base.recompute)):
            assert t.a2 == pytest.approx(b.a2 / 4 + a2a, rel=1e-9), name
            assert (t.a1, t.a1c, t.ac) == pytest.approx((b.a1 / 4, b.a1c / 4, b.ac / 4))
            assert t.b1 == pytest.approx(b.b1 + 4 * 3e-3 * 2)  # 4 latencies of log2(4) NVLink hops, 3 us each
        assert got.head_fwd.a2 == pytest.approx(base.head_fwd.a2 / 4)
        assert got.memory.p2p_token == pytest.approx(base.memory.p2p_token / 4)


def test_replicated_kv_are_gathered_whole():
    net = Network("n16", 50.0, 3.0, 50.0, 8.0, nvlink_gbps=100.0, nvlink_latency_us=0.0, gpus_per_node=16)
    base = analytic_profile(LLAMA_GQA, 1)
    split, replicated = place_profile(base, ParallelDims(cp=8), net), place_profile(base, ParallelDims(cp=16), net)
    kv = LLAMA_GQA.kv_hidden  # 1024
    assert split.fwd.a2 - base.fwd.a2 / 8 == pytest.approx(2 * (2 * 4096 / 8 + 2 * kv / 8) * 7 / 8 / 100e9 * 1e3)
    assert replicated.fwd.a2 - base.fwd.a2 / 16 == pytest.approx(2 * (2 * 4096 / 16 + 2 * kv) * 15 / 16 / 100e9 * 1e3)


def test_model_states_replicated_over_cp_optimizer_sharded_over_dp_x_cp():
    shape, cluster = MODEL_PRESETS["llama-13b"], get_cluster("a800-ib-gpu")
    cp1 = CostModel(stage(shape, cluster, 2, 1, 4), 2, dp=4)
    cp2 = CostModel(stage(shape, cluster, 2, 2, 4), 2, dp=4)
    dp8 = CostModel(stage(shape, cluster, 2, 1, 4), 2, dp=8)
    m = cp1.profile.memory
    params = shape.rank_parameters(cp1.layers, 2)
    assert cp1.model_state_bytes() == pytest.approx(params * (m.weight + m.grad + m.optim / 4))
    assert cp2.model_state_bytes() == pytest.approx(params * (m.weight + m.grad + m.optim / 8))  # weights, grads whole
    assert cp2.model_state_bytes() == pytest.approx(dp8.model_state_bytes())


def test_chunks_padded_to_a_multiple_of_cp_and_the_activations_of_a_rank():
    shape, cluster = MODEL_PRESETS["llama-7b"], get_cluster("h100-ib-node")
    one = CostModel(stage(shape, cluster, 1, 1, 4), 2)
    four = CostModel(stage(shape, cluster, 1, 4, 4), 2)
    feats = sequence_features([7, 4096])
    c1, c4 = one.costs(feats), four.costs(feats)
    assert c1.tokens.tolist() == [7, 4096] and c4.tokens.tolist() == [8, 4096]
    ratio = c4.act_layer[1] / c1.act_layer[1]
    assert 0.25 < ratio < 0.3  # a CP rank's share, the attention output held twice
    assert c4.fwd[:, 1].sum() < c1.fwd[:, 1].sum() / 3


def test_measured_memory_carried_to_cp_once():
    """A measured memory block placed at cp (by its basis count's ratio) stays there when the cost model re-derives
    its shape: the placement is idempotent."""
    profile = load_profile("test-model")
    measured = replace(profile, memory=replace(profile.memory, derive=MEASURED_MEMORY, basis="saved-tensors",
                                               act_token=1.1 * profile.memory.act_token))
    placed = place_profile(measured, ParallelDims(cp=2), Network("x", 1.0, 1.0, 1.0, 1.0))
    assert placed.memory.act_token == pytest.approx(1.1 * saved_tensor_memory(TEST_MODEL, profile.tp, cp=2)["act_token"])
    assert shape_memory(placed).memory == placed.memory
    assert CostModel(placed, 2).profile.memory == placed.memory


def test_online_planner_plans_at_cp():
    from megatron_epp.planner.config import PlannerConfig
    from megatron_epp.planner.online import OnlinePlanner
    from megatron_epp.base.units import GIB

    config = PlannerConfig(memory_budget_bytes=0.05 * GIB, max_seq_len=1024, max_slices=8)
    one = OnlinePlanner(config, TEST_MODEL, ParallelDims(pp=2), load_profile("test-model"))
    two = OnlinePlanner(config, TEST_MODEL, ParallelDims(pp=2, cp=2), load_profile("test-model"))
    assert one.cost_model.profile.cp == 1 and two.cost_model.profile.cp == 2
    feats = sequence_features([1000])
    assert two.cost_model.costs(feats).act_layer[0] < 0.6 * one.cost_model.costs(feats).act_layer[0]
    step = two([900, 500, 300, 100])
    assert np.isfinite(step.report.predicted_step_ms)


def test_gradient_sync_over_dp_x_cp():
    """The CP ranks hold the same weights: the gradient reduce-scatter and the weights' all-gather run over DP x CP,
    of the GPU's whole TP shard; at cp 1 over DP as before."""
    from megatron_epp.cost.clusters import COMM_OVERLAP
    from megatron_epp.planner.layout import dp_sync_ms, layout_cost_model

    shape, cluster = MODEL_PRESETS["llama-7b"], get_cluster("a800-ib-node")
    for layout, group in ((ParallelDims(tp=2, pp=1, dp=8, cp=2), 16), (ParallelDims(tp=2, pp=1, dp=16, cp=1), 16), (ParallelDims(tp=4, pp=2, dp=2, cp=2), 4), (ParallelDims(tp=8, pp=1, dp=4, cp=1), 4)):
        cm = layout_cost_model(shape, cluster, layout)
        params = shape.rank_parameters(cm.layers, layout.tp).max()
        comm = sum(cluster.strided_allgather_ms(b * params, group, layout.tp * layout.pp) for b in (4.0, 2.0))
        assert dp_sync_ms(cm, cluster, layout) == pytest.approx((1 - COMM_OVERLAP) * comm), str(layout)
    same = [dp_sync_ms(layout_cost_model(shape, cluster, x), cluster, x) for x in (ParallelDims(tp=2, pp=1, dp=8, cp=2), ParallelDims(tp=2, pp=1, dp=16, cp=1))]
    assert same[0] == pytest.approx(same[1])
