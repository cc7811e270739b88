"""Hand-checked small cases of every planner step."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_epp.plan import Chunk, Pipeline, Plan, PlanInfeasible, Segment
from megatron_epp.planner.recompute import MemoryInfeasible, solve_recompute
from megatron_epp.planner.chunking import BISECTION_STEPS, build_units, equal_count_cuts, pack, slice_cuts
from megatron_epp.cost.features import F, chunk_features, segment_features, sequence_features
from megatron_epp.cost.model import CostModel
from megatron_epp.planner.grouping import group_units
from megatron_epp.simulator.memory import pipeline_memory, stage_memory
from megatron_epp.cost.network import Network
from megatron_epp.base.units import GIB
from megatron_epp.cost.analytic import analytic_profile
from megatron_epp.cost.profile import MemoryCoeffs, Profile, TimeCoeffs
from megatron_epp.cost.profile_lookup import load_profile
from megatron_epp.cost.shape import MODEL_PRESETS
from megatron_epp.simulator.step import ScheduleDeadlock, simulate

IDEAL = Network("ideal", 1e30, 0.0, 1e30, 0.0)


def toy_cost_model(num_stages: int = 2, layers: list[int] | None = None, kv_grad: float = 0.0) -> CostModel:
    """1 ms per token per layer forward, 2 backward, recompute = forward; 10 B/token/layer of
    activations, 1 B kept by a checkpointed layer, 2 B of K/V buffer; the allocator's view of a backward
    (one layer's activations of workspace), K/V gradient accumulators only with ``kv_grad``; no model
    states, no network."""
    shape = MODEL_PRESETS["llama-7b"]
    zero = TimeCoeffs(0, 0, 0, 0, 0, 0)
    prof = Profile(
        model=shape, device="toy", source="analytic", tp=1,
        fwd=TimeCoeffs(0, 0, 1.0, 0, 0, 0), bwd=TimeCoeffs(0, 0, 2.0, 0, 0, 0), recompute=TimeCoeffs(0, 0, 1.0, 0, 0, 0),
        head_fwd=zero, head_bwd=zero,
        memory=MemoryCoeffs(10.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, False, 0.0, kv_grad=kv_grad),
    )
    layers = layers or [1] * num_stages
    return CostModel(prof, num_stages, layers, network=IDEAL)


def batched(i: int, seq: int, n: int) -> Chunk:
    return Chunk(i, "batched", [Segment(seq, 0, n)])


# ------------------------------------------------------------------------------------ cost model
def test_chunk_features_sum_segments_and_count_launches():
    c = Chunk(0, "hybrid", [Segment(0, 100, 130), Segment(1, 0, 20)])
    f = chunk_features([c])[0]
    assert f.tolist() == [30 * 30 + 20 * 20, 30 * 100, 50, 100, 2, 1]
    assert (f[F.SQ], f[F.SC], f[F.S], f[F.C], f[F.SEGMENTS], f[F.CHUNKS]) == tuple(f)
    # a whole sequence is a chunk of one segment without prefix, and a segment alone a chunk of its own
    whole = chunk_features([Chunk(0, "batched", [Segment(0, 0, 700)]), Chunk(1, "split", [Segment(0, 100, 130)])])
    assert sequence_features([700]).tolist() == whole[:1].tolist()
    assert segment_features([30], [100]).tolist() == whole[1:].tolist()


def test_analytic_profile_is_causal_flash_form_and_scales_with_tp():
    p8, p1 = analytic_profile(MODEL_PRESETS["llama-13b"], 8), analytic_profile(MODEL_PRESETS["llama-13b"], 1)
    assert p8.source == "analytic" and p8.fwd.a1c == pytest.approx(2 * p8.fwd.a1)
    assert p1.fwd.a1 == pytest.approx(8 * p8.fwd.a1)
    # Megatron's 34 h / tp, its MLP term with SwiGLU: 6 f in place of 4 f (16 h)
    assert p8.memory.act_token == pytest.approx((34 * 5120 + 6 * 13824 - 16 * 5120) / 8) and p8.memory.act_area == 0
    # 13B layer: 2 * 317M FLOPs per token at 0.5 * 990 TFLOP/s on 8 GPUs, plus TP communication
    assert p8.fwd.a2 > 2 * MODEL_PRESETS["llama-13b"].gemm_flops_per_token() / 2 / (8 * 0.5 * 990e12) * 1e3


def test_profile_json_round_trip_and_shipped_cpu_profile(tmp_path):
    p = analytic_profile(MODEL_PRESETS["llama-7b"], 4)
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p
    cpu = load_profile("test-model")
    assert cpu.source == "measured" and cpu.tp == 1 and cpu.model.hidden == 64
    assert cpu.bwd.a2 > 0 and cpu.fwd.a1 > 0 and "errors" in cpu.fit


def test_model_states_put_embedding_first_and_head_last():
    cm = CostModel(analytic_profile(MODEL_PRESETS["llama-13b"], 8), 4, dp=2)
    s = cm.model_state_bytes()
    shape = MODEL_PRESETS["llama-13b"]  # norms whole on every tensor-parallel rank, the rest split over 8
    per_layer = ((shape.params_per_layer() - 2 * shape.hidden) / 8 + 2 * shape.hidden) * (2 + 4 + 12 / 2)
    assert s[1] == pytest.approx(10 * per_layer)
    assert s[0] > s[1] and s[3] > s[1]


# ------------------------------------------------------------------------------------ chunking
def test_equal_time_slices_follow_sqrt_law_earlier_longer():
    w = np.array([1.0, 2.0, 0, 0, 0, 0])  # work of a slice = (C + s)^2 - C^2
    cuts = slice_cuts(np.array([100]), 2500.0, 10**6, w)[0]
    assert cuts.tolist() == [0, 50, 71, 87, 100]
    assert np.all(np.diff(np.diff(cuts)) < 0)  # slices get shorter
    assert np.allclose(cuts, 100 * np.sqrt(np.arange(5) / 4), atol=1)


def test_token_cap_bounds_slices_and_equal_count_cuts():
    w = np.array([0.0, 0, 1.0, 0, 0, 0])
    assert slice_cuts(np.array([10]), 100.0, 4, w)[0].tolist() == [0, 4, 8, 10]
    cuts = equal_count_cuts(np.array([1000, 10]), 4, np.array([1.0, 2.0, 0, 0, 0, 0]), 10**6)
    assert [len(c) - 1 for c in cuts] == [4, 4]
    work = np.diff(cuts[0].astype(float) ** 2)
    assert work.max() / work.min() < 1.05


def test_equal_count_cuts_are_the_sequential_bisections():
    """equal_count_cuts takes several bisection steps per pass (every path's midpoints at once): its cuts are those of
    the plain bisection, step by step on the per-sequence budget, counting slices with slice_cuts."""
    rng = np.random.default_rng(7)
    for trial in range(8):  # work vectors of the shape of the analytic profiles' (prefix term small)
        w = np.array([rng.uniform(1e-8, 1e-6), rng.uniform(1e-8, 2e-6), rng.uniform(1e-4, 1e-3), rng.uniform(0, 1e-9), 0.01, 0.05])
        L = np.maximum(rng.lognormal(np.log(8000), 1.4, rng.integers(1, 30)).astype(np.int64), 1)
        cap = int(rng.choice([4096, 32768]))
        for k in (2, 3, 8):
            one_chunk = sequence_features(L) @ w
            lo, hi = one_chunk / (4 * k), one_chunk
            for _ in range(BISECTION_STEPS):
                mid = (lo + hi) / 2
                too_many = np.array([len(c) - 1 for c in slice_cuts(L, mid, cap, w)]) > k
                lo, hi = np.where(too_many, mid, lo), np.where(too_many, hi, mid)
            want = slice_cuts(L, hi, cap, w)
            got = equal_count_cuts(L, k, w, cap)
            assert [c.tolist() for c in got] == [c.tolist() for c in want], (trial, k)


def test_best_fit_decreasing_packing():
    sizes = np.array([5, 4, 3, 2])
    where = pack(sizes, sizes.astype(float), np.zeros(0), np.zeros(0), 0.0, 7.0, 100)
    assert where == [0, 1, 1, 0]
    # a tail seeds bucket 0; the token cap forbids putting 4 with it
    where = pack(np.array([4, 1]), np.array([1.0, 1.0]), np.array([1.0]), np.array([8]), 0.0, 10.0, 10)
    assert where == [1, 0]


def test_build_units_split_hybrid_batched():
    w = np.array([0.0, 0, 1.0, 0, 0, 0])  # work = tokens
    chunking = build_units(np.array([25, 3, 4, 30]), w, 10.0, 10)
    chunks, ends = chunking.chunks(), np.cumsum(chunking.unit_sizes)
    units = [chunks[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    kinds = [[c.kind for c in u] for u in units]
    assert kinds[0] == ["split", "split", "hybrid"] or kinds[0] == ["split", "split", "split"]
    covered = {}
    for u in units:
        for c in u:
            for s in c.segments:
                covered[s.seq] = covered.get(s.seq, 0) + s.length
            assert c.num_tokens <= 10
    assert covered == {0: 25, 1: 3, 2: 4, 3: 30}
    assert sum(c.kind == "hybrid" for u in units for c in u) >= 1


# ------------------------------------------------------------------------------------ memory
def test_memory_walk_matches_hand_count():
    cm = toy_cost_model(2)
    pipe = Pipeline([batched(0, 0, 4), batched(1, 1, 2), batched(2, 2, 3)], [[0, 0, 0], [0, 0, 0]])
    costs = cm.costs(chunk_features(pipe.chunks))
    s0 = stage_memory(pipe, 0, 2, costs, 1, 0.0)
    assert [f"{o.kind}{o.pos}" for o in s0.ops] == ["F0", "F1", "B0", "F2", "B1", "B2"]
    assert s0.during([0, 0, 0]).tolist() == [40, 60, 100, 50, 70, 60]
    assert s0.during([1, 0, 0]).tolist() == [4, 24, 64, 50, 70, 60]
    s1 = stage_memory(pipe, 1, 2, costs, 1, 5.0)
    assert s1.during([0, 0, 0]).tolist() == [45, 85, 25, 45, 35, 65]


def test_split_slices_keep_kv_until_first_slice_backward():
    cm = toy_cost_model(1)
    pipe = Pipeline([Chunk(0, "split", [Segment(0, 0, 2)]), Chunk(1, "split", [Segment(0, 2, 4)])], [[0, 0]])
    costs = cm.costs(chunk_features(pipe.chunks))
    sm = stage_memory(pipe, 0, 1, costs, 1, 0.0)
    assert [f"{o.kind}{o.pos}" for o in sm.ops] == ["F0", "F1", "B1", "B0"]
    # slice 0: 20 B of activations + the sequence's K/V buffer (2 B x 4 tokens); slice 1 (the tail):
    # 20 B; workspace in backward
    assert sm.during([0, 0]).tolist() == [28, 48, 68, 48]
    # checkpointing slice 0 keeps its input (2 B) and the K/V buffer (8 B); its recompute holds 20 + 8
    assert sm.during([1, 0]).tolist() == [10, 30, 50, 30]
    # with the K/V gradient accumulators (8 B: the buffer's size) from slice 1's backward on: B0 starts with
    # 28 + 20 + 8; slice 1's rows after its start stay below 68 (28 + 18 + 8; 28 + 8 + 18 - (8 - 2)); a
    # checkpointed slice 0 recomputes holding 18 + 1 x (2 + 8 + 8) = 36, under its start's 10 + 20 + 8
    costs = toy_cost_model(1, kv_grad=1.0).costs(chunk_features(pipe.chunks))
    sm = stage_memory(pipe, 0, 1, costs, 1, 0.0)
    assert sm.during([0, 0]).tolist() == [28, 48, 68, 56]
    assert sm.during([1, 0]).tolist() == [10, 30, 50, 38]
    assert sm.rows([0, 0]).tolist() == [28, 48, 68, 54, 48, 56, 18]


# ------------------------------------------------------------------------------------ recompute
def _brute_force(mems, rc, layers, budget):
    P, n = len(mems), len(rc)
    best = None
    for x in itertools.product(*[range(int(min(layers)) + 1)] * (n + P - 1)):
        r = [[x[k - p + P - 1] for k in range(n)] for p in range(P)]
        if all(sm.during(r[p]).max() <= budget for p, sm in enumerate(mems)):
            cost = sum(r[p][k] * rc[k] for p in range(P) for k in range(n))
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("budget", [95.0, 80.0, 60.0, 45.0])
def test_ilp_is_optimal_on_anti_diagonals_and_fits(budget):
    cm = toy_cost_model(2, [2, 2])
    pipe = Pipeline([batched(0, 0, 2), batched(1, 1, 1), batched(2, 2, 2)], [[0] * 3] * 2)
    costs = cm.costs(chunk_features(pipe.chunks))
    mems = pipeline_memory(pipe, costs, cm.layers, np.zeros(2))
    res = solve_recompute(mems, costs.rc_layer, cm.layers, budget)
    r = res.recompute
    assert all(r[0][k] == r[1][k + 1] for k in range(2))
    assert all(sm.during(r[p]).max() <= budget + 1e-9 for p, sm in enumerate(mems))
    assert res.recompute_ms == pytest.approx(_brute_force(mems, costs.rc_layer, cm.layers, budget))
    greedy = solve_recompute(mems, costs.rc_layer, cm.layers, budget, mode="greedy")
    assert all(sm.during(greedy.recompute[p]).max() <= budget + 1e-9 for p, sm in enumerate(mems))
    assert greedy.recompute_ms >= res.recompute_ms - 1e-9 and greedy.gap >= 0


def test_recompute_infeasible_and_no_recompute_when_it_fits():
    cm = toy_cost_model(2, [2, 2])
    pipe = Pipeline([batched(0, 0, 2), batched(1, 1, 2)], [[0] * 2] * 2)
    costs = cm.costs(chunk_features(pipe.chunks))
    mems = pipeline_memory(pipe, costs, cm.layers, np.zeros(2))
    assert sum(map(sum, solve_recompute(mems, costs.rc_layer, cm.layers, 1e6).recompute)) == 0
    with pytest.raises(MemoryInfeasible):
        solve_recompute(mems, costs.rc_layer, cm.layers, 10.0)
    with pytest.raises(MemoryInfeasible):
        solve_recompute(mems, costs.rc_layer, cm.layers, 60.0, mode="none")


# ------------------------------------------------------------------------------------ grouping
def test_grouping_separates_long_sequence_only_when_memory_demands():
    cm = toy_cost_model(2)
    units = [[Chunk(0, "split", [Segment(0, 0, 5)]), Chunk(1, "split", [Segment(0, 5, 10)]), Chunk(2, "split", [Segment(0, 10, 15)])]]
    units += [[batched(3 + i, 1 + i, 5)] for i in range(4)]
    costs = cm.costs(chunk_features([c for u in units for c in u]))
    groups, _ = group_units([3, 1, 1, 1, 1], costs, cm.layers, free_bytes=1e9)
    assert groups == [(0, 5)]
    # every chunk holds 50 B on stage 0 (+ 50 B workspace in backward), a slice of the long sequence
    # also its 10 B of the K/V buffer; in one group the window is P + K - 1 = 4 chunks (280 B); the
    # long sequence alone needs 230 B, the short ones 2 chunks (150 B)
    groups, cost = group_units([3, 1, 1, 1, 1], costs, cm.layers, free_bytes=240.0, recompute=False)
    assert groups == [(0, 1), (1, 5)] and np.isfinite(cost)


# ------------------------------------------------------------------------------------ simulator
def test_simulator_reproduces_1f1b_step_time():
    cm = toy_cost_model(3)
    n = 5
    pipe = Pipeline([batched(i, i, 1) for i in range(n)], [[0] * n for _ in range(3)])
    plan = Plan([1] * n, 3, [1, 1, 1], [pipe])
    sim = simulate(plan.validate(), cm)
    assert sim.step_ms == pytest.approx((n + 3 - 1) * (1 + 2))
    assert sim.busy_ms.tolist() == [15, 15, 15]
    assert sim.bubble_ratio == pytest.approx(1 - 15 / 21)
    pipe.recompute[0] = [1] * n
    assert simulate(plan, cm).recompute_ms == pytest.approx(n)


def test_elastic_plan_is_never_predicted_slower_than_packing_alone():
    """The slice-count search scores candidates by a proxy; the plan it returns must still be at
    least as fast, by the simulator, as packing whole sequences (one slice budget)."""
    import dataclasses

    from megatron_epp.data.mock_documents import WIKIPEDIA_LENGTHS, lengths_from_file
    from megatron_epp.planner.epp import build_plan

    profile = load_profile("test-model")
    cm = CostModel(dataclasses.replace(profile, model=dataclasses.replace(profile.model, num_layers=4, vocab=257)), 2)
    for seed in range(12):
        lengths = lengths_from_file(WIKIPEDIA_LENGTHS, 16, seed, max_length=1024).tolist()
        elastic = build_plan(lengths, cm, 0.05 * GIB, recompute="none")
        packed = build_plan(lengths, cm, 0.05 * GIB, recompute="none", slice_counts=[1])
        assert elastic.report.predicted_step_ms <= packed.report.predicted_step_ms + 1e-6, (seed, elastic.summary())


def test_deadlock_shows_where_each_stage_waits_and_the_op_order():
    """Slices of sequence 0 not consecutive (validate would reject it): the last stage's backward of
    the second slice comes before its forward, so the first stage waits in the receive of that backward's gradient."""
    chunks = [Chunk(0, "split", [Segment(0, 0, 5)]), Chunk(1, "batched", [Segment(1, 0, 3)]), Chunk(2, "split", [Segment(0, 5, 10)])]
    plan = Plan([10, 3], 2, [1, 1], [Pipeline(chunks, [[0, 0, 0], [0, 0, 0]])])
    with pytest.raises(ScheduleDeadlock) as failure:
        simulate(plan, CostModel(load_profile("test-model"), 2, np.array([1, 1])))
    message = str(failure.value)
    assert message.startswith("no stage can run its next op: stage 0 at step 6 (+RECV_B2s), stage 1 at step 4 (B2s); the op order:\n")
    assert "\nStep 04  F2s        B2s\nStep 05  SEND_F2s   SEND_B2s\nStep 06  +RECV_B2s  +RECV_F2s\n" in message


def test_no_candidate_slices_below_the_smallest_token_cap(monkeypatch):
    """Slice budgets are searched only down to a first slice of MIN_CHUNK_TOKENS' work: below it the cuts are a few
    tokens (1-token chunks where the budget is below the per-chunk constant) and the recompute program grows with the
    batch's token count (a 695-token batch planned in 7-25 s, the answer depending on load)."""
    from megatron_epp.planner import epp

    cm = CostModel(load_profile("test-model"), 1)
    lengths = [286, 56, 28, 140, 36, 101, 44, 4]
    w = cm.work_vector()
    least = float(sequence_features([epp.MIN_CHUNK_TOKENS])[0] @ w)
    budgets = []
    real = epp._Search.score

    def score(self, budget_t, cap, balance, recompute, margin=0.0):
        budgets.append((budget_t, cap, balance))
        return real(self, budget_t, cap, balance, recompute, margin)

    monkeypatch.setattr(epp._Search, "score", score)
    states = float(cm.model_state_bytes()[0])
    plan = epp.build_plan(lengths, cm, states + 0.003 * GIB)
    assert budgets and all(t >= least for t, _, balance in budgets if balance), min(t for t, _, b in budgets if b) / least
    assert all(c >= epp.MIN_CHUNK_TOKENS for t, c, balance in budgets if not balance)
    assert plan.report.fits
    # a budget whose memory cap is below the smallest token cap (39 tokens here): one line, not an IndexError
    assert epp.token_cap(cm, states + 0.0015 * GIB) < epp.MIN_CHUNK_TOKENS
    with pytest.raises(PlanInfeasible, match="no 'adaptive' plan fits"):
        epp.build_plan(lengths, cm, states + 0.0015 * GIB)


def test_grouping_prune_changes_no_answer():
    """The grouping DP skips units reached dearer than the best whole answer so far: on random unit sets, budgets from
    nothing-fits to everything-fits, with and without recompute, the answer's cost equals the unpruned DP's."""
    from megatron_epp.cost.model import ChunkCosts
    from megatron_epp.planner.grouping import group_units_both

    rng = np.random.default_rng(0)
    compared = 0
    for _ in range(300):
        sizes = sorted(rng.choice([1, 1, 1, 2, 3, 5], size=int(rng.integers(2, 10))).tolist(), reverse=True)
        n, P = sum(sizes), int(rng.integers(2, 5))
        act = rng.uniform(10, 100, n)
        costs = ChunkCosts(fwd=rng.uniform(1, 10, (P, n)), bwd=rng.uniform(2, 20, (P, n)), rc_layer=rng.uniform(0.5, 5, n),
                           act_layer=act, ckpt_layer=act * rng.uniform(0.05, 0.3, n), rc_input=np.zeros(n),
                           kv_layer=rng.uniform(0, 10, n), lone_layer=np.zeros(n), logits=np.zeros(n), embed=np.zeros(n),
                           workspace=np.zeros(n), kv_grad=1.0, p2p_ms=np.zeros(n), tokens=np.ones(n))
        layers = np.full(P, 2)
        free = float(rng.uniform(0.2, 1.5) * layers[0] * act.sum())
        pruned, full = group_units_both(sizes, costs, layers, free), group_units_both(sizes, costs, layers, free, prune=False)
        for flag in (True, False):
            assert pruned[flag][1] == pytest.approx(full[flag][1]), (sizes, free, flag)
            compared += bool(np.isfinite(full[flag][1]))
    assert compared > 300  # most cases have an answer to compare
