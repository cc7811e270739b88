"""The per-step metrics record: the log line people read is printed from it, and it round-trips JSON."""

from __future__ import annotations

import pytest

from megatron_epp.training.metrics import ElasticMetrics, StepMetrics, read_metrics

MB = 2**20
LINE = (
    " iteration        2/       6 | consumed samples:         32 | elapsed time per iteration (ms): 3999.3 | "
    "tokens/s: 3794 | learning rate: 2.250000E-03 | lm loss: 5.157642E+00 | grad norm: 2.2691 | plan[epp] seqs=16 "
    "tokens=15172 chunks=74 (batched=0 split=73 hybrid=1) pipelines=1 recomputed_layers=0 | planning ms: 132.3 "
    "(hidden) | predicted ms: 682.3 | measured ms: 3961.0 | act MB pred/meas per stage: 22.40/23.40, 22.20/21.90"
)


def elastic_step(**change) -> StepMetrics:
    elastic = dict(
        plan="plan[epp] seqs=16 tokens=15172 chunks=74 (batched=0 split=73 hybrid=1) pipelines=1 recomputed_layers=0",
        num_chunks={"batched": 0, "split": 73, "hybrid": 1}, num_pipelines=1, recomputed_layers=0, planning_ms=132.3,
        planning_wait_ms=0.2, predicted_step_ms=682.3, measured_ms=3961.0,
        predicted_activation_bytes=[22.4 * MB, 22.2 * MB], measured_activation_bytes=[round(23.4 * MB), round(21.9 * MB)],
    )
    elastic.update(change)
    return StepMetrics(2, 5.157642, train_iters=6, consumed_samples=32, iter_ms=3999.3, tokens=15172, lr=2.25e-3,
                       grad_norm=2.2691, elastic=ElasticMetrics(**elastic))


def test_the_log_line_is_printed_from_the_record():
    assert elastic_step().line() == LINE
    exposed = elastic_step(planning_wait_ms=12.34, predicted_step_ms=None, measured_activation_bytes=None).line()
    assert exposed.endswith("recomputed_layers=0 | planning ms: 132.3 (exposed 12.3 ms) | measured ms: 3961.0")
    # a prediction on the memory model calibrated to the measured peaks says its factor over the raw model's
    calibrated = elastic_step(memory_factor=1.3305).line()
    assert calibrated == LINE + " (pred = 1.331 x the raw memory model's)"
    assert elastic_step(memory_factor=1.0).line() == LINE
    assert elastic_step(memory_factor=1.3305).scalars()["memory/activation factor"] == 1.3305
    for padding, said in ((1, "padding: 1 token | "), (3, "padding: 3 tokens | ")):
        assert f"recomputed_layers=0 | {said}planning ms:" in elastic_step(padding_tokens=padding).line()
    # the elastic builder's plan beside the baselines it weighed: their predicted step time over the plan's
    ratios = elastic_step(baseline_ratios={"megatron": 1.1667, "seq1f1b-k2": 1.0951})
    assert "recomputed_layers=0 | baseline/plan predicted: megatron 1.17x, seq1f1b-k2 1.10x | planning ms:" in ratios.line()
    assert {k: v for k, v in ratios.scalars().items() if k.endswith(" / plan")} == {
        "plan/predicted megatron / plan": 1.1667, "plan/predicted seq1f1b / plan": 1.0951}
    # activation offload: the host bytes per stage the plan was predicted with and the host pool's measured peak
    host = elastic_step(offloaded_layers=5, predicted_host_bytes=[0.5 * MB, 0.25 * MB], measured_host_bytes=[MB // 2, MB // 4])
    assert host.line() == LINE + " | host MB pred/meas per stage: 0.50/0.50, 0.25/0.25"
    assert {k: v for k, v in host.scalars().items() if "host" in k or "offloaded" in k} == {
        "plan/offloaded checkpoints": 5.0, "memory/stage 0 predicted host MB": 0.5, "memory/stage 1 predicted host MB": 0.25,
        "memory/stage 0 measured host MB": 0.5, "memory/stage 1 measured host MB": 0.25}
    plain = StepMetrics(2, 5.157642, train_iters=6, consumed_samples=32, iter_ms=3999.3, tokens=15172, lr=2.25e-3, grad_norm=2.2691)
    assert plain.line() == LINE.split(" | plan[")[0]
    assert StepMetrics(4, 2.0, kind="valid").line() == " validation loss at iteration 4 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00"


def test_records_round_trip_json_lines(tmp_path):
    records = [elastic_step(memory_factor=1.25, baseline_ratios={"megatron": 1.25}), StepMetrics(2, 4.25, kind="valid"), StepMetrics(3, 1 / 3, train_iters=6, consumed_samples=48,
                                                                               iter_ms=10.0, tokens=100, lr=1e-3, grad_norm=0.5)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in records))
    assert read_metrics(path) == records
    assert '"tokens_per_s": 10000.0' in records[2].to_json()


def test_model_flops_match_a_hand_count():
    from megatron_epp.cost.shape import ModelShape

    shape = ModelShape("tiny", num_layers=2, hidden=8, num_heads=2, ffn_hidden=32, vocab=10, swiglu=False)
    # per layer and token: QKV 2*8*24 + projection 2*8*8 + MLP 2*(8*32 + 32*8) = 384 + 128 + 1024 = 1536 FLOPs;
    # documents of 3 and 1 tokens, causal: 3*4/2 + 1 = 7 query-key pairs at 4*8 FLOPs; head 2*8*10 per token
    forward = 2 * (1536 * 4 + 4 * 8 * 7) + 2 * 8 * 10 * 4
    assert shape.training_flops([3, 1]) == 3 * forward == 40128
    # a 10-token document cut into slices of 4 and 6: the second slice's 6 queries see the 4 earlier keys and
    # themselves causally, 6*4 + 6*7/2 = 45 pairs, the first 4*5/2 = 10: the whole document's 10*11/2 = 55
    slices = 3 * (2 * (1536 * 10 + 4 * 8 * (10 + 45)) + 2 * 8 * 10 * 10)
    assert shape.training_flops([10]) == slices
    # two 5-token documents packed into one chunk do not attend to each other: 2 * 15 pairs, not 55
    assert shape.training_flops([5, 5]) == slices - 3 * 2 * 4 * 8 * (55 - 30)
    gated = ModelShape("tiny", 2, 8, 2, 32, 10, swiglu=True)  # SwiGLU: a third MLP matrix
    assert gated.training_flops([1]) - shape.training_flops([1]) == 3 * 2 * 2 * 8 * 32


def test_throughput_in_the_line_and_scalars():
    step = elastic_step()
    step.tflops_per_gpu = 0.01234
    assert " | tokens/s: 3794 | throughput per GPU (TFLOP/s/GPU): 0.012 | learning rate: " in step.line()
    scalars = step.scalars()
    assert scalars["throughput TFLOP/s/GPU"] == 0.01234 and scalars["lm loss"] == 5.157642
    assert scalars["plan/chunks split"] == 73 and scalars["plan/chunks hybrid"] == 1 and scalars["plan/recomputed layers"] == 0
    assert scalars["plan/predicted ms"] == 682.3 and scalars["plan/measured ms"] == 3961.0
    assert scalars["memory/stage 1 predicted activation MB"] == pytest.approx(22.2)
    assert scalars["memory/stage 0 measured activation MB"] == pytest.approx(23.4, abs=1e-6)
    assert StepMetrics(4, 2.0, kind="valid").scalars() == {"validation lm loss": 2.0}


def logger_args(tmp_path, **change):
    from megatron_epp.config.parser import parse_config

    cfg = parse_config(["--mock-data", "--seed", "3"], world_size=1)
    logging = dict(tensorboard_dir=str(tmp_path / "tb"), wandb_project=None, wandb_exp_name=None, wandb_save_dir=None,
                   epp_metrics=None)
    return cfg.replace(logging={**logging, **change})


def runtime():
    import torch

    from megatron_epp.base.dims import ParallelDims
    from megatron_epp.model.runtime import Runtime

    return Runtime(torch.device("cpu"), rank=0, pp_rank=0, tp_rank=0, dp_rank=0, dims=ParallelDims())


def test_tensorboard_gets_every_scalar(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_epp.training.loop import Logger

    logger = Logger(logger_args(tmp_path), runtime())
    step = elastic_step()
    logger.record(step)
    logger.record(StepMetrics(2, 4.5, kind="valid"))
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == set(step.scalars()) | {"validation lm loss"}
    assert {"plan/chunks batched", "plan/pipelines", "memory/stage 1 measured activation MB", "tokens/s", "grad-norm"} <= tags
    (value,) = events.Scalars("plan/predicted ms")
    assert (value.step, value.value) == (2, pytest.approx(682.3))


def test_wandb_gets_the_same_scalars(tmp_path, monkeypatch):
    import sys
    import types

    from megatron_epp.training.loop import Logger

    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)), log=lambda d, step: calls.append(("log", d, step)),
                                 finish=lambda: calls.append(("finish",)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = Logger(logger_args(tmp_path, tensorboard_dir=None, wandb_project="epp", wandb_exp_name="run-1",
                                wandb_save_dir=str(tmp_path / "wb")), runtime())
    step = elastic_step()
    logger.record(step)
    logger.close()
    (_, init), (_, logged, at), finish = calls
    assert (init["project"], init["name"], init["dir"]) == ("epp", "run-1", str(tmp_path / "wb"))
    config = init["config"]  # the typed config, flat and JSON-friendly
    assert config["training.seed"] == 3 and config["parallel.dims.tp"] == 1 and config["logging.wandb_project"] == "epp"
    assert all(isinstance(v, (bool, int, float, str, list, type(None))) for v in config.values())
    assert logged == step.scalars() and at == 2 and finish == ("finish",)


def test_wandb_flags_are_checked_before_work(monkeypatch):
    import sys

    from megatron_epp.config.parser import parse_config
    from megatron_epp.config.errors import ArgumentError

    monkeypatch.setitem(sys.modules, "wandb", None)  # as here: wandb is not installed
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "wandb" else object())
    with pytest.raises(ArgumentError, match="--wandb-project p: wandb is not installed"):
        parse_config(["--mock-data", "--wandb-project", "p"], world_size=1)
    with pytest.raises(ArgumentError, match="--wandb-exp-name needs --wandb-project"):
        parse_config(["--mock-data", "--wandb-exp-name", "x"], world_size=1)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # installed: accepted, dir under --save
    cfg = parse_config(["--mock-data", "--wandb-project", "p", "--save", "/tmp/ck"], world_size=1)
    assert cfg.logging.wandb_save_dir == "/tmp/ck/wandb"
