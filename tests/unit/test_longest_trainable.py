"""benchmarks/longest_trainable.py (issue 41's GPU demonstration, prepared on CPU): the search over probes (doubling,
bisection to the resolution, the probe and time limits) on a fake device whose longest trainable length is known; a
failed run's outcome from its error line; the probes' flags as pretrain_gpt.py parses them; one real probe on the CPU
that trains and one its start-up check refuses; bad input in one line."""

from __future__ import annotations

import time

import pytest

from benchmarks import longest_trainable as lt
from tests.unit.test_benchmark_cli import one_line_error


def fake(limit: int, calls: list):
    """A probe that trains every length up to ``limit`` and refuses the rest."""
    def probe(tokens: int, mode: str) -> lt.Probe:
        calls.append((tokens, mode))
        return lt.Probe(tokens, "trained" if tokens <= limit else "refused", 0.0)
    return probe


@pytest.mark.parametrize("limit, max_probes, longest, failed", [
    (70_000, 8, 69_632, 73_728),  # doubled to 131,072, then bisected to within 4,096: 8 probes
    (70_000, 5, 65_536, 98_304),  # the probe limit stops the bisection early
    (16_383, 8, 12_288, 16_384),  # not even the first: bisected below it
    (10**9, 5, 262_144, None),  # the probe limit stops the doubling
])
def test_search_finds_the_longest_trainable_length(limit, max_probes, longest, failed):
    calls: list = []
    good, bad, probes = lt.search(fake(limit, calls), "none", 16_384, 4096, max_probes, time.perf_counter() + 60, log=lambda _: None)
    assert (good, bad) == (longest, failed) and len(probes) == len(calls) <= max_probes
    assert all(n % 4096 == 0 and mode == "none" for n, mode in calls)
    assert [p.outcome == "trained" for p in probes] == [n <= limit for n, _ in calls]


def test_search_stops_at_the_deadline():
    calls: list = []
    good, bad, probes = lt.search(fake(10**9, calls), "none", 1024, 512, 10, time.perf_counter() - 1, log=lambda _: None)
    assert (good, bad, probes, calls) == (0, None, [], [])


def test_a_failed_runs_outcome():
    assert lt.classify("pretrain_gpt.py failed (1): pretrain_gpt.py: error: --epp-memory-budget 4 GB: 1 documents ... cannot be planned") == "refused"
    assert lt.classify("pretrain_gpt.py failed (1): torch.OutOfMemoryError: CUDA out of memory. Tried to allocate") == "oom"
    assert lt.classify("pretrain_gpt.py failed (-9): Killed") == "error"


def test_the_probes_flags_parse_and_one_real_probe_each_way(tmp_path, monkeypatch):
    """The flags pretrain_gpt.py gets (one document of the length a step, the offload mode); on the CPU a 1,024-token
    document trains within 6 MB (the allocator peak and model states printed against the budget), a 4,096-token one is
    refused by the start-up check before any work."""
    from megatron_epp.training.replay import parsed_config

    data = lt.document_dataset(64, count=2)
    cfg = parsed_config([*lt.run_argv(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"], 64, "checkpoints",
                                      0.006, 2, data)], 1)
    assert cfg.model.seq_length == 64 and cfg.training.global_batch_size == 1 and cfg.epp.planner.offload == "checkpoints"
    probe = lt.real_probe(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"], 0.006, 2, 300)
    trained, refused = probe(1024, "none"), probe(4096, "none")
    assert trained.outcome == "trained" and len(trained.steps) == 2 and "of 0.006 (model states + measured activations)" in trained.detail
    assert all(max(s.elastic.measured_activation_bytes) + max(s.elastic.model_state_bytes) <= 0.006 * 2**30 for s in trained.steps)
    assert refused.outcome == "refused" and "cannot be planned" in refused.detail
    assert lt.median_step_ms(trained) > 0 and lt.offloaded(trained) == 0 and lt.median_step_ms(refused) is None


def test_bad_input_is_one_line(capsys):
    base = ["--model-flags", "--num-layers 2", "--epp-memory-budget", "1"]
    for argv, said in (([*base, "--modes", "none,all"], "--modes none,all: each one of none, checkpoints, auto"),
                       ([*base, "--iters", "1"], "--iters must be >= 2"),
                       (["--model-flags", "x", "--epp-memory-budget", "0"], "--epp-memory-budget must be positive"),
                       ([*base, "--resolution", "0"], "--resolution must be >= 1")):
        assert said in one_line_error(capsys, lambda: lt.parse(argv))
    assert lt.main([*base, "--dry-run"]) == {}
    assert "--epp-offload checkpoints" in capsys.readouterr().out
