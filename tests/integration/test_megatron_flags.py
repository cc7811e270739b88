"""Megatron-LM's flags (those of its LLaMA example scripts and the common ones besides): each parsed with its
Megatron-LM meaning, accepted with its "no effect here" said in --help and at start-up, or refused in one line that
says why; --help describes every flag; WSD, --lr-warmup-fraction, NullTokenizer, --eod-mask-loss and --fp16 with its
loss scale as Megatron-LM's; examples/train_llama3_8b.sh (Megatron-LM's layout) trains at SIZE=toy."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from collections import Counter

import numpy as np
import pytest
import torch

from megatron_epp.data.documents import DocumentDataset
from megatron_epp.data.gpt_samples import MockGPTSamples, sample_dict
from megatron_epp.data.tokenizers import NullTokenizer, TokenizerError, build_tokenizer
from megatron_epp.planner.epp import in_units
from megatron_epp.config.parser import build_parser, parse_config
from megatron_epp.config.fields import TrainingConfig
from megatron_epp.config.megatron_flags import ACCEPTED, REFUSED, startup_notes
from megatron_epp.training.metrics import read_metrics
from tests.launch import REPO, free_port, run_env
from tests.unit.test_driver_flags import lrs_after_steps


def test_help_describes_every_flag():
    undescribed = [a.option_strings[0] for a in build_parser()._actions
                   if a.option_strings and (not a.help or a.help == argparse.SUPPRESS)]
    assert undescribed == []


@pytest.mark.parametrize("flag, says", [
    ("--hidden-dropout", "Megatron-LM: 0.1"), ("--attention-dropout", "Megatron-LM: 0.1"),
    ("--adam-beta2", "Megatron-LM: 0.999"), ("--position-embedding-type", "Megatron-LM: learned_absolute"),
    ("--lr-decay-style", "Megatron-LM: linear"), ("--micro-batch-size", "replace micro-batches"),
    ("--use-mcore-models", "accepted: the model is always megatron-core's GPTModel"),
    ("--fp8-format", "refused: fp8 needs Transformer Engine"),
])
def test_help_says_where_a_default_or_a_meaning_differs_from_megatron_lm(flag, says):
    action = next(a for a in build_parser()._actions if flag in a.option_strings)
    assert says in action.help


def parsed(*flags: str, world_size: int = 1) -> TrainingConfig:
    return parse_config(["--mock-data", *flags], world_size=world_size)


@pytest.mark.parametrize("flags, expected", [
    (["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"], {"position_embedding_type": "rope"}),
    (["--no-position-embedding"], {"add_position_embedding": False, "position_embedding_type": "rope"}),
    (["--rotary-percent", "0.5"], {"rotary_percent": 0.5}),
    (["--apply-layernorm-1p"], {"apply_layernorm_1p": True}),
    (["--attention-backend", "local"], {"attention_backend": "local"}),
    (["--elastic-pp", "--attention-backend", "fused"], {"attention_backend": "fused"}),
    (["--no-masked-softmax-fusion"], {"masked_softmax_fusion": False}),
    ([], {"rope_fusion": True, "bias_swiglu_fusion": True, "cross_entropy_loss_fusion": False}),  # Megatron-LM's defaults
    (["--no-rope-fusion", "--no-bias-swiglu-fusion", "--cross-entropy-loss-fusion"],
     {"rope_fusion": False, "bias_swiglu_fusion": False, "cross_entropy_loss_fusion": True, "accepted_flags": ()}),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"], {"vocab_size": 101, "eod": 100}),
    (["--elastic-pp", "--micro-batch-size", "4", "--global-batch-size", "6"], {"micro_batch_size": 4, "global_batch_size": 6}),
    (["--train-iters", "8", "--global-batch-size", "2", "--lr-warmup-fraction", "0.25"], {"lr_warmup_samples": 4.0}),
    (["--train-samples", "40", "--global-batch-size", "4", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "8"],
     {"lr_wsd_decay_samples_total": 8, "train_iters": 10}),
    (["--train-iters", "10", "--global-batch-size", "2", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "3"],
     {"lr_wsd_decay_samples_total": 6, "lr_wsd_decay_style": "exponential"}),
    (["--decoupled-lr", "5e-4", "--decoupled-min-lr", "4.5e-5"], {"decoupled_lr": 5e-4, "decoupled_min_lr": 4.5e-5}),
    (["--fp16", "--loss-scale", "128"], {"fp16": True, "loss_scale": 128.0}),
    (["--fp16"], {"loss_scale": None, "initial_loss_scale": 2.0**32, "min_loss_scale": 1.0, "loss_scale_window": 1000,
                  "hysteresis": 2}),  # Megatron-LM's defaults
    (["--bf16", "--grad-reduce-in-bf16"], {"grad_reduce_in_bf16": True}),
    (["--manual-gc", "--manual-gc-interval", "5"], {"manual_gc": True, "manual_gc_interval": 5, "manual_gc_eval": True}),
    (["--optimizer", "sgd", "--sgd-momentum", "0.5"], {"optimizer": "sgd", "sgd_momentum": 0.5}),
    (["--eod-mask-loss"], {"eod_mask_loss": True}),
    (["--split", "'99,1,0'"], {"split": "'99,1,0'"}),  # as a shell array of Megatron-LM's examples passes it
    (["--use-distributed-optimizer", "--overlap-param-gather"], {"accepted_flags": ("--overlap-param-gather",)}),
])
def test_megatron_flags_parse_with_their_meaning(flags, expected):
    values = parsed(*flags).values()  # the config's fields by their flags' names
    assert {key: getattr(values, key) for key in expected} == expected


@pytest.mark.parametrize("entry", ACCEPTED, ids=lambda e: e.flag)
def test_accepted_flags_are_named_at_start_up(entry):
    value = {"--num-workers": ["2"], "--data-cache-path": ["cache"], "--tiktoken-pattern": ["v2"],
             "--distributed-backend": ["gloo"], "--transformer-impl": ["local"], "--dataloader-type": ["single"],
             "--rerun-mode": ["disabled"]}.get(entry.flag, [])
    extra = ["--use-distributed-optimizer"] if entry.flag == "--overlap-param-gather" else []
    notes = startup_notes(parsed(entry.flag, *value, *extra))
    assert [n for n in notes if n.startswith("Megatron-LM flags accepted with no effect here") and entry.flag in n]
    assert not [n for n in startup_notes(parsed()) if "accepted" in n]


def test_elastic_start_up_says_what_micro_batch_size_means():
    notes = startup_notes(parsed("--elastic-pp", "--micro-batch-size", "2", "--global-batch-size", "4"))
    assert notes[0].startswith("batch: --elastic-pp plans each step's 4 documents (global batch) into chunks, which "
                               "replace micro-batches")


def test_sequence_parallel_at_tp1_is_turned_off_with_a_line_as_megatron_lm():
    """Upstream's LLaMA-3 script passes --sequence-parallel at tp 1: Megatron-LM turns it off with a warning, so do we."""
    cfg = parsed("--sequence-parallel")
    assert cfg.parallel.dims.sequence_parallel is False
    assert [n for n in startup_notes(cfg) if n.startswith("--sequence-parallel at --tensor-model-parallel-size 1: turned off")]
    assert not [n for n in startup_notes(parsed()) if "--sequence-parallel" in n]
    assert parsed("--sequence-parallel", "--tensor-model-parallel-size", "2", world_size=2).parallel.dims.sequence_parallel


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_flags_say_why_in_one_line(pretrain_in_process, flag):
    proc = pretrain_in_process("--mock-data", flag, "1")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"pretrain_gpt.py: error: argument {flag}: not supported here: {REFUSED[flag]}"


@pytest.mark.parametrize("flags, message", [
    (["--no-position-embedding", "--position-embedding-type", "learned_absolute"], "a model without positions is not supported"),
    (["--rotary-percent", "0"], "--rotary-percent 0.0: must be in (0, 1]"),
    (["--rotary-percent", "0.5", "--position-embedding-type", "learned_absolute"], "--rotary-percent applies only with"),
    (["--fp16", "--bf16"], "--fp16 and --bf16: give one"),
    (["--loss-scale", "8"], "--loss-scale applies only with --fp16"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale 0.0: must be > 0"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--lr-wsd-decay-iters", "2"], "--lr-wsd-decay-iters applies only with --lr-decay-style WSD"),
    (["--train-samples", "8", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"], "with --train-samples give --lr-wsd-decay-samples"),
    (["--train-iters", "4", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5"], "--lr-wsd-decay-iters is longer than the decay"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction and --lr-warmup-iters: give one"),
    (["--lr-warmup-fraction", "1.0"], "--lr-warmup-fraction 1.0: must be in [0, 1)"),
    (["--manual-gc-interval", "3"], "--manual-gc-interval applies only with --manual-gc"),
    (["--overlap-param-gather"], "--overlap-param-gather applies only with --use-distributed-optimizer"),
    (["--attention-backend", "fused"], "--attention-backend fused: Transformer Engine's attention, not available here (no CUDA device)"),
    (["--elastic-pp", "--use-flash-attn"], "--attention-backend flash: flash-attn does not import"),
    (["--tokenizer-type", "NullTokenizer"], "--tokenizer-type NullTokenizer needs --vocab-size N"),
    (["--use-mcore-model"], "unrecognized arguments: --use-mcore-model"),
    (["--profile", "--profile-ranks", "0", "3"], "--profile-ranks 3: no such rank (the ranks are 0 to 0)"),
    (["--profile", "--use-pytorch-profiler"], "--use-pytorch-profiler writes its trace under --tensorboard-dir"),
])
def test_bad_megatron_flags_give_one_line_error(pretrain_in_process, flags, message):
    proc = pretrain_in_process("--mock-data", *flags)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.parametrize("style, annealed", [
    ("exponential", lambda r: 2.0 * 0.5**r - 1.0), ("linear", lambda r: 1.0 - r),
    ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1.0)), ("minus_sqrt", lambda r: 1.0 - math.sqrt(r)),
])
def test_wsd_with_warmup_fraction_follows_megatron_lm(style, annealed):
    """10 iterations of 1 sample, --lr 1e-2: warm-up 0.2 x 10 = 2 samples (Megatron-LM's --lr-warmup-fraction of the
    decay), the peak until the last --lr-wsd-decay-iters 4, then annealed (Megatron-LM's formula per style) to --min-lr."""
    lrs = lrs_after_steps(["--train-iters", "10", "--lr-warmup-fraction", "0.2", "--lr-decay-style", "WSD",
                           "--lr-wsd-decay-iters", "4", "--lr-wsd-decay-style", style, "--min-lr", "1e-3"], 10)
    expected = [1e-2 * n / 2 if n <= 2 else 1e-2 if n <= 6 else 1e-3 + 9e-3 * annealed((n - 6) / 4) for n in range(1, 11)]
    assert lrs == pytest.approx(expected)
    assert lrs[-1] == pytest.approx(1e-3)


def test_null_tokenizer_as_megatron_lm():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer) and (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize("5 17 99") == [5, 17, 99] and tok.detokenize([5, 17, 100]) == "5 17 100"
    with pytest.raises(TokenizerError, match="token id 101 outside the vocabulary 0..100"):
        tok.tokenize("3 101")
    with pytest.raises(TokenizerError, match="space-separated token ids"):
        tok.tokenize("hello")


def test_prepare_data_with_null_tokenizer_and_append_eod(tmp_path):
    (tmp_path / "a.txt").write_text("1 2 3")
    proc = subprocess.run(
        ["python3", "-m", "megatron_epp.data.prepare", "--input", str(tmp_path / "a.txt"), "--output-prefix",
         str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--append-eod", "--no-progress"],
        env=run_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    docs = DocumentDataset(str(tmp_path / "out"))
    assert docs[0].tolist() == [1, 2, 3, 10]  # the end-of-document id is --vocab-size


def test_eod_mask_loss_masks_the_token_after_an_end_of_document():
    sample = sample_dict(np.array([4, 9, 5, 9, 9, 2]), eod_mask=9)
    assert sample["tokens"].tolist() == [4, 9, 5, 9, 9]
    assert sample["loss_mask"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert sample_dict(np.array([4, 9, 5]))["loss_mask"].tolist() == [1.0, 1.0]
    masked = MockGPTSamples(64, 7, eod_mask=6)[0]  # mock progressions mod 7 hold the end-of-document id 6
    assert (masked["loss_mask"] == (masked["tokens"] != 6).float()).all() and masked["loss_mask"].min() == 0


def test_memory_error_sizes_are_never_zero_of_zero():
    assert in_units(17.3 * 2**30, 20 * 2**30) == "17.3 of 20.0 GB"
    assert in_units(3.4 * 2**20, 2**20) == "3.4 of 1.0 MB"
    assert in_units(0.4 * 2**30) == "409.6 MB"


def fp16_step(*flags: str):
    """One training step of a 2-layer fp16 model on mock data (megatron-core's schedule, one rank): the model's
    gradient buffer after the backward, whether the optimizer applied the update, and the loss scale after it."""
    from megatron.core import tensor_parallel

    from megatron_epp.measure.layer_bench import init_single_process
    from megatron_epp.training.gpt_step import gpt_forward_step, microbatches
    from megatron_epp.base.dims import ParallelDims
    from megatron_epp.model.runtime import Runtime
    from megatron_epp.training.loop import build_optimizer
    from megatron_epp.training.step import StockTrainStep, build_samples
    from megatron_epp.model.gpt import build_model

    init_single_process()
    args = (parsed("--fp16", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "16",
                                           "--global-batch-size", "2", *flags))
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    runtime = Runtime(torch.device("cpu"), rank=0, pp_rank=0, tp_rank=0, dp_rank=0, dims=ParallelDims())
    model, config = build_model(args, runtime)
    optimizer, _ = build_optimizer(args, model, config)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    before = optimizer.get_loss_scale().item()
    batches = microbatches(build_samples(args, "train"), 0, 2, 1, 0, 1, runtime.device)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    StockTrainStep(args, model, gpt_forward_step, batches)(False)
    grads = torch.cat([b.grad_data.float().clone() for b in model.buffers])
    update_ok, _, _ = optimizer.step()
    return before, grads, update_ok, optimizer.get_loss_scale().item()


def test_fp16_scales_the_loss_and_skips_an_overflowing_step():
    scale1, grads1, ok1, _ = fp16_step("--loss-scale", "1")
    scale, grads, ok, after = fp16_step("--loss-scale", "1024")
    assert (scale1, scale, ok1, ok, after) == (1.0, 1024.0, True, True, 1024.0)
    # the backward ran on the scaled loss (elementwise only roughly: unscaled, fp16's small gradients underflow)
    assert torch.linalg.vector_norm(grads) / torch.linalg.vector_norm(grads1) == pytest.approx(1024, rel=1e-2)
    # dynamic scaling, as Megatron-LM: 2^40 overflows fp16's gradients: the update is skipped and the scale halved
    start, _, ok, after = fp16_step("--initial-loss-scale", str(2.0**40), "--hysteresis", "1")
    assert (start, ok, after) == (2.0**40, False, 2.0**39)


def test_llama3_8b_example_trains_at_toy_size(tmp_path):
    """examples/train_llama3_8b.sh, Megatron-LM's LLaMA-3-8B script with --elastic-pp added, at SIZE=toy: its flags all
    parse, 6 iterations of 8 documents train on 2 CPU ranks (pp 2), evaluate and save; the start-up lines say what
    --micro-batch-size, --attention-backend fused and the accepted flags mean here. Its --profile --profile-step-start 4
    --profile-step-end 6, here with --use-pytorch-profiler on both ranks, write one torch.profiler trace per rank under
    the --tensorboard-dir, each named in a line, holding iterations 4 and 5 only, with one forward and one backward
    range per chunk of their plans."""
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    proc = subprocess.run(
        ["bash", str(REPO / "examples/train_llama3_8b.sh"), str(ckpt), str(tb), "MOCK", "MOCK", "--use-pytorch-profiler",
         "--profile-ranks", "0", "1"], cwd=tmp_path,
        env=run_env({"SIZE": "toy", "MASTER_PORT": str(free_port())}), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = proc.stdout
    assert "> architecture: SwiGLU MLP, LayerNorm (eps 1e-05, zero-centred weight: 1p), grouped-query attention 4:2" in out
    assert out.count(f"> warning: --load {ckpt}: no checkpoint there yet") == 1  # --save X --load X, first run: one line
    assert "> --sequence-parallel at --tensor-model-parallel-size 1: turned off, as Megatron-LM does" in out
    assert "> batch: --elastic-pp plans each step's 8 documents" in out
    assert "> --attention-backend fused: Transformer Engine's cuDNN attention is not used with --elastic-pp" in out
    assert "--use-mcore-models" in out and "--num-workers" in out
    losses = [float(line.split("lm loss: ")[1].split()[0]) for line in out.splitlines() if line.startswith(" iteration ")
              and "lm loss: " in line]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert out.count("validation loss at iteration") == 2
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == ["iter_0000003", "iter_0000006"]
    assert f"> profile: torch.profiler records iterations 4 to 5 on ranks 0, 1 (record_shapes, with_stack); each rank " \
           f"writes its trace to {tb}" in out
    check_profiled_plans(out, tb)


def check_profiled_plans(out: str, tb) -> None:
    """Each rank's trace (named in its line) holds the profiler steps of iterations 4 and 5 only, and inside each one
    forward and one backward range per chunk of that iteration's plan (the --epp-metrics record's chunk counts by
    kind, its pipelines and tokens), of the rank's own stage; no range outside them."""
    plans = {m.iteration: m for m in read_metrics(tb / "metrics.jsonl") if m.kind == "train"}
    for rank in (0, 1):  # pp 2: rank r is stage r
        path = next(line for line in out.splitlines() if line.startswith(f" profile: rank {rank} wrote")).split(" to ")[-1]
        assert f" profile: rank {rank} wrote the torch.profiler trace of iterations 4 to 5 to {path}" in out
        events = json.loads(open(path).read())["traceEvents"]
        steps = {int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("name", "").startswith("ProfilerStep#")}
        assert sorted(steps) == [4, 5]
        ranges = [e for e in events if e.get("name", "").startswith("epp ")]
        assert ranges and all(any(begin <= e["ts"] <= end for begin, end in steps.values()) for e in ranges)
        for iteration, (begin, end) in steps.items():
            names = [e["name"].split() for e in ranges if begin <= e["ts"] <= end]
            assert {" ".join(name[6:8]) for name in names} == {f"stage {rank}"}
            forward = sorted(tuple(name[2:6]) for name in names if name[1] == "F")  # pipeline, chunk, kind, tokens
            assert forward == sorted(tuple(name[2:6]) for name in names if name[1] == "B")
            record = plans[iteration]
            assert Counter(kind for _, _, kind, _ in forward) == +Counter(record.elastic.num_chunks), iteration
            assert {p for p, *_ in forward} == {f"p{i}" for i in range(record.elastic.num_pipelines)}
            assert sum(int(tokens.removesuffix("t")) for *_, tokens in forward) == record.tokens


def test_llama3_8b_example_trains_at_toy_size_with_context_parallelism(tmp_path):
    """examples/train_llama3_8b.sh at SIZE=toy with CP_SIZE=2 PP_SIZE=1 (the ranks: 2): the script's flags with
    --context-parallel-size 2 train 2 iterations of 8 documents on 2 CPU ranks, planned by Seq1F1B (4 slices per
    document: split chunks, each slice's prefix K/V held per CP rank for its heads), the start-up lines saying the
    layout and what CP means here; the log line has each CP rank's measured activation peak."""
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    proc = subprocess.run(
        ["bash", str(REPO / "examples/train_llama3_8b.sh"), str(ckpt), str(tb), "MOCK", "MOCK", "--train-samples", "16",
         "--profile-step-start", "1", "--profile-step-end", "2", "--epp-plan", "seq1f1b", "--epp-max-slices", "4"],
        cwd=tmp_path, env=run_env({"SIZE": "toy", "CP_SIZE": "2", "PP_SIZE": "1", "MASTER_PORT": str(free_port())}),
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = proc.stdout
    assert "| tp=1 cp=2 pp=1 dp=1 on cpu" in out
    assert "> context parallelism: --context-parallel-size 2 is Ulysses all-to-all here (--cp-comm-type a2a" in out
    steps = [line for line in out.splitlines() if line.startswith(" iteration ")]
    assert len(steps) == 2 and all("act MB meas per stage and CP rank: " in line for line in steps), steps
    assert all("plan[seq1f1b-k4]" in line and " split=0 " not in line for line in steps), steps
    assert all(math.isfinite(float(line.split("lm loss: ")[1].split()[0])) for line in steps)


@pytest.mark.parametrize("size, world, dims", [("8b", 32, (2, 1, 4, 4)), ("8b-128k", 32, (2, 4, 4, 1))])
def test_llama3_8b_example_flags_parse_at_full_size(tmp_path, size, world, dims):
    """examples/train_llama3_8b.sh at its GPU sizes (the command it would run, printed with PYTHON=echo): pretrain_gpt.py
    parses its flags for a world of ``world`` ranks into (tp, cp, pp, dp) ``dims``; 8b-128k: --seq-length 131072 with
    --context-parallel-size 4."""
    proc = subprocess.run(["bash", str(REPO / "examples/train_llama3_8b.sh"), str(tmp_path / "c"), str(tmp_path / "t")],
                          cwd=tmp_path, env=run_env({"SIZE": size, "PYTHON": "echo"}), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.split()
    cfg = parse_config(argv[argv.index(str(REPO / "pretrain_gpt.py")) + 1:], world_size=world)
    d = cfg.parallel.dims
    assert (d.tp, d.cp, d.pp, d.dp) == dims and cfg.model.seq_length == (131072 if size == "8b-128k" else 8192)
