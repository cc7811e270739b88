"""pretrain_gpt.py's flags as the driver applies them: the LR schedule the loop builds from the parsed flags."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

import pytest
import torch

from megatron_epp.config.parser import parse_config
from megatron_epp.measure.layer_bench import init_single_process
from megatron_epp.training.corpus_check import check_corpus
from megatron_epp.training.faults import TrainingFault, check_finite
from megatron_epp.training import loop
from megatron_epp.base.dims import ParallelDims
from megatron_epp.model.runtime import Runtime, process_groups
from megatron_epp.training.loop import build_scheduler
from megatron_epp.training.metrics import read_metrics
from tests.corpus import write_corpus


def lrs_after_steps(flags: list[str], steps: int) -> list[float]:
    """The learning rate after each of ``steps`` iterations, from the scheduler the loop builds for ``flags``."""
    args = parse_config(["--mock-data", "--global-batch-size", "1", "--lr", "1e-2", "--lr-decay-style", "constant", *flags],
                        world_size=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.optim.lr)
    scheduler = build_scheduler(args, optimizer)
    out = []
    for _ in range(steps):
        scheduler.step(increment=args.training.global_batch_size)  # as the loop: one global batch of samples
        out.append(optimizer.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize("flags", [
    ["--train-iters", "6", "--lr-warmup-iters", "4"],
    ["--train-samples", "6", "--lr-warmup-samples", "4"],  # Megatron-LM's schedule in samples: the same warm-up
])
def test_warmup_ramps_from_lr_warmup_init_in_iterations_and_in_samples(flags):
    assert lrs_after_steps(flags, 5) == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2])
    ramp = lrs_after_steps([*flags, "--lr-warmup-init", "2e-3"], 2)
    assert ramp == pytest.approx([4e-3, 6e-3])
    assert lrs_after_steps(flags[:2], 2) == pytest.approx([1e-2, 1e-2])  # no warm-up: --lr from the first step


@pytest.mark.parametrize("flags, message", [
    (["--num-layers", "0"], "--num-layers 0: must be >= 1"),
    (["--num-attention-heads", "0"], "--num-attention-heads 0: must be >= 1"),
    (["--hidden-size", "0"], "--hidden-size 0: must be >= 1"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size 0: must be >= 1"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0: must be >= 1"),
    (["--global-batch-size", "0"], "--global-batch-size 0: must be >= 1"),
    (["--seq-length", "0"], "--seq-length 0: must be >= 1"),
    (["--vocab-size", "0"], "--vocab-size 0: must be >= 1"),
    (["--eval-interval", "-1"], "--eval-interval -1: must be >= 1"),
    (["--eval-iters", "-1"], "--eval-iters -1: must be >= 0"),
    (["--lr", "-1"], "--lr -1.0: must be >= 0"),
    (["--lr", "nan"], "--lr nan: must be >= 0"),
    (["--min-lr", "1e-2"], "--min-lr 0.01 is larger than --lr 0.001"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout 1.5: must be in [0, 1]"),
    (["--adam-beta2", "1"], "--adam-beta2 1.0: must be in [0, 1)"),
    (["--lr-warmup-init", "1"], "--lr-warmup-init 1.0: must be between 0 and --lr 0.001"),
    (["--swiglu", "--hidden-size", "16", "--num-attention-heads", "2"], "--swiglu with --hidden-size 16: give --ffn-hidden-size (the default rounds 8/3 x hidden down to 64s: 0)"),
])
def test_numeric_flag_out_of_range_is_one_line(pretrain_in_process, flags, message):
    proc = pretrain_in_process("--mock-data", *flags)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"pretrain_gpt.py: error: {message}"], proc.stderr


@pytest.mark.parametrize("split, message", [
    ("abc", "--split abc: expected 1 to 3 non-negative train,valid,test weights"),
    ("1,-1,1", "--split 1,-1,1: expected"),  # megatron-core's parser would read 1,1,1
    ("1,2,3,4", "--split 1,2,3,4: expected"),
    ("0,0,0", "--split 0,0,0: expected"),
    ("1e-3,1,1", "--split 1e-3,1,1: expected"),  # megatron-core's parser would read 1,3,1,1
    ("0,1,0", "--mock-data --split 0,1,0: the train share is 0, nothing to train on"),
])
def test_bad_split_is_one_line(pretrain_in_process, split, message):
    proc = pretrain_in_process("--mock-data", "--split", split)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt.py: error: {message}"), proc.stderr


@pytest.mark.parametrize("split", ["969,30,1", "99/1", "1", " 8, 1.5, .5"])
def test_good_split_is_accepted(split):
    assert parse_config(["--mock-data", "--split", split], world_size=1).data.split == split


@pytest.mark.parametrize("flags, message", [
    (["--recompute-num-layers", "3"], "--recompute-num-layers applies only with --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "3"],
     "--recompute-num-layers applies only with --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "-1"],
     "--recompute-num-layers -1: must be between 1 and the 4 layers of a pipeline stage"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3",
      "--pipeline-model-parallel-size", "2"], "--recompute-num-layers 3: must be between 1 and the 2 layers"),
    (["--elastic-pp", "--recompute-num-layers", "3"], "--recompute-num-layers does not apply with --elastic-pp"),
    (["--elastic-pp", "--recompute-method", "block"], "--recompute-method does not apply with --elastic-pp"),
])
def test_recompute_flags_megatron_core_would_refuse_or_ignore(pretrain_in_process, flags, message):
    world_size = int(flags[flags.index("--pipeline-model-parallel-size") + 1]) if "--pipeline-model-parallel-size" in flags else 1
    proc = pretrain_in_process("--mock-data", "--num-layers", "4", *flags, world_size=world_size)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt.py: error: {message}"), proc.stderr


def test_full_recompute_defaults_to_one_layer():
    cfg = parse_config(["--mock-data", "--recompute-granularity", "full", "--recompute-method", "block"], world_size=1)
    assert cfg.model.recompute_num_layers == 1


def test_eval_iters_0_turns_evaluation_off():
    """Megatron-LM's --eval-iters 0: no evaluation (it was a training step, then a ZeroDivisionError)."""
    assert parse_config(["--mock-data", "--eval-interval", "1", "--eval-iters", "0"], world_size=1).logging.eval_interval is None
    assert parse_config(["--mock-data", "--eval-interval", "1", "--eval-iters", "1"], world_size=1).logging.eval_interval == 1


@pytest.mark.parametrize("data", ["mock", "corpus"])
def test_an_empty_validation_split_is_said_once(tmp_path, data):
    """--eval-interval with a --split that leaves the validation split empty: training without evaluation, and one
    warning line that says so (the mock streams honour --split's shares as the indexed datasets do)."""
    source = ["--mock-data"] if data == "mock" else ["--data-path", write_corpus(tmp_path / "corpus", ["some text " * 4] * 10)]

    def note(*flags):
        return check_corpus(parse_config([*source, "--seq-length", "16", *flags], world_size=1))[1]

    assert note("--eval-interval", "2", "--split", "1,0,0") == (
        "--eval-interval 2: the validation split of --split 1,0,0 is empty; training without evaluation")
    assert note("--eval-interval", "2", "--split", "8,2,0") is None
    assert note("--split", "1,0,0") is None  # no evaluation asked for


def test_nan_check_is_on_by_default_with_megatron_lm_spelling_to_turn_it_off():
    assert parse_config(["--mock-data"], world_size=1).training.check_for_nan_in_loss_and_grad is True
    assert parse_config(["--mock-data", "--no-check-for-nan-in-loss-and-grad"], world_size=1).training.check_for_nan_in_loss_and_grad is False


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_check_sees_one_bad_gradient_or_loss(bad):
    """The default check (a sum per gradient buffer) sees one non-finite element among finite ones."""
    init_single_process()
    buffers = [SimpleNamespace(grad_data=torch.ones(1000)), SimpleNamespace(grad_data=torch.full((1000,), -1e30))]
    loss = torch.tensor([2.0, 3.0])
    check_finite(4, loss, buffers, 0, torch.device("cpu"))  # all finite: no stop
    buffers[1].grad_data[517] = bad
    with pytest.raises(TrainingFault, match="a gradient is NaN/Inf at iteration 4 on rank 0"):
        check_finite(4, loss, buffers, 0, torch.device("cpu"))
    loss[1] = bad
    with pytest.raises(TrainingFault, match="the loss is NaN/Inf at iteration 4 on rank 0"):
        check_finite(4, loss, buffers[:1], 0, torch.device("cpu"))


def test_log_line_averages_over_the_interval_as_megatron_lm_and_the_record_is_the_step(tmp_path, monkeypatch, capsys):
    """--log-interval 2: the line at iteration 4 shows ms/iter, lm loss and tokens/s of iterations 3-4 averaged, the
    learning rate and grad norm of iteration 4; the --epp-metrics record of iteration 4 holds iteration 4's own.
    The loop runs on stand-ins for the model, optimizer and step (one process)."""
    init_single_process()
    args = parse_config(["--mock-data", "--train-iters", "4", "--log-interval", "2", "--global-batch-size", "2",
                         "--lr-decay-style", "constant", "--epp-metrics", str(tmp_path / "m.jsonl")], world_size=1)
    clock = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: clock[0], time=lambda: 0.0))
    steps = iter([(0.1, 4.0, 100), (0.3, 2.0, 300), (0.2, 3.0, 100), (0.6, 1.0, 200)])  # (seconds, loss, tokens)

    class TrainStep:  # a stand-in for the stock step: no metrics or state of its own
        def __call__(self, forward_only):
            seconds, loss, tokens = next(steps)
            clock[0] += seconds
            return [{"lm loss": torch.tensor([loss * tokens, tokens])}], np.array([tokens // 2, tokens - tokens // 2])

        def log(self, iteration):
            return None

        def state_dict(self):
            return None

    norms = iter([5.0, 6.0, 7.0, 8.0])
    optimizer = SimpleNamespace(zero_grad=lambda: None, step=lambda: (True, next(norms), None), param_groups=[{}])
    scheduler = SimpleNamespace(step=lambda increment: None, get_lr=lambda group: 1e-3)
    model = SimpleNamespace(zero_grad_buffer=lambda: None, buffers=[])
    runtime = Runtime(torch.device("cpu"), rank=0, pp_rank=0, tp_rank=0, dp_rank=0, dims=ParallelDims(), pg_collection=process_groups())
    capsys.readouterr()
    loop.train(args, runtime, model, optimizer, scheduler, train_step=TrainStep(), valid_step=None)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("iteration")]
    assert len(lines) == 2
    assert "elapsed time per iteration (ms): 400.0 | tokens/s: 375 |" in lines[1], lines[1]  # 0.8 s, 300 tokens
    assert "lm loss: 2.000000E+00 | grad norm: 8.0000" in lines[1], lines[1]  # (3 + 1) / 2; iteration 4's norm
    assert "elapsed time per iteration (ms): 200.0 | tokens/s: 1000 |" in lines[0], lines[0]
    record = read_metrics(tmp_path / "m.jsonl")[1]
    assert (record.iteration, record.iter_ms, record.loss, record.tokens, record.grad_norm) == (4, pytest.approx(600.0), 1.0, 200, 8.0)
