"""The per-step metrics record: the log line people read is printed from it, and it round-trips JSON."""

from __future__ import annotations

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
    plain = StepMetrics(2, 5.157642, train_iters=6, consumed_samples=32, iter_ms=3999.3, tokens=15172, lr=2.25e-3, grad_norm=2.2691)
    assert plain.line() == LINE.split(" | plan[")[0]
    assert StepMetrics(4, 2.0, kind="valid").line() == " validation loss at iteration 4 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00"


def test_records_round_trip_json_lines(tmp_path):
    records = [elastic_step(), StepMetrics(2, 4.25, kind="valid"), StepMetrics(3, 1 / 3, train_iters=6, consumed_samples=48,
                                                                               iter_ms=10.0, tokens=100, lr=1e-3, grad_norm=0.5)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in records))
    assert read_metrics(path) == records
    assert '"tokens_per_s": 10000.0' in records[2].to_json()
