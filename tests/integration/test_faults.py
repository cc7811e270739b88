"""Long runs as a cluster runs them (pretrain_gpt.py, torchrun pp=2, tiny model): SIGTERM saves and exits
0 and the run resumes bit for bit; a killed rank ends the job; a NaN stops the run naming the
iteration and the rank; a crash while saving leaves the previous checkpoint loadable; a truncated or
foreign checkpoint and a .bin/.idx that do not match are one-line errors before training.

Faults are planted with the test-only EPP_FAULT_INJECT (megatron_epp/training/faults.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import time

import pytest
import torch

from megatron_epp.measure.layer_bench import init_single_process
from megatron_epp.training import launch
from megatron_epp.config.parser import parse_config
from megatron_epp.config.errors import ArgumentError
from megatron_epp.checkpoint.integrity import check_loadable, record_sha256
from megatron_epp.checkpoint.records import METADATA, TRACKER, checkpoint_metadata, data_change
from megatron_epp.training.corpus_check import check_corpus
from megatron_epp.training.faults import ExitConditions
from megatron_epp.training.metrics import read_metrics
from tests.launch import torchrun, torchrun_signalled_after
from tests.corpus import write_corpus
from tests.integration.test_elastic_training import RUN

ITERS = 8
# bit-identical resumption needs the same plans: no online calibration of the cost model
SHORT = [*RUN[:RUN.index("--train-iters")], "--train-iters", str(ITERS), *RUN[RUN.index("--train-iters") + 2:],
         "--epp-calibrate-interval", "0"]
FLAGS = SHORT[1:]  # without the script
DP2_SHARDED = ["--pipeline-model-parallel-size", "1", "--use-distributed-optimizer"]
HANG_TIMEOUT_MINUTES = 0.25  # --distributed-timeout-minutes of the hang case
TORCHRUN_GRACE_S = 30  # torchrun's wait between the SIGTERM and the SIGKILL it sends the ranks left
KILL_BOUND_S = 20  # a SIGKILLed rank's job ends by itself in seconds, well before that grace would end it


def losses(path) -> dict[int, float]:
    return {m.iteration: m.loss for m in read_metrics(path) if m.kind == "train"}


@pytest.fixture(scope="module")
def straight_dp2(tmp_path_factory):
    """The uninterrupted run the SIGTERM cases resume to: its losses by iteration."""
    path = tmp_path_factory.mktemp("straight") / "straight.jsonl"
    torchrun(2, *SHORT, *DP2_SHARDED, "--epp-metrics", str(path))
    return losses(path)


@pytest.mark.parametrize("to", ["ranks", "launcher"])
def test_sigterm_saves_at_the_end_of_the_step_exits_0_and_resumes_bit_identical(tmp_path, straight_dp2, to):
    """Data parallel 2 with --use-distributed-optimizer (each rank saves its shard of the Adam states; the
    elastic sampler resumes at the consumed samples of both replicas); pp 2 resumes in the tests below and in
    tests/integration/test_elastic_training.py.

    ranks: SIGTERM to both ranks of a plain torchrun with --exit-signal-handler (as SLURM signals every process).
    launcher: SIGTERM to the launcher only (megatron_epp.training.launch, as every launch script starts torchrun;
    as a scheduler or `docker stop` signals the job's first process), with --save alone: the launcher adds
    --exit-signal-handler, forwards the signal to the ranks and exits with their status, 0 (plain torchrun, so
    signalled, exits 1). The resume verifies the saved checkpoint's checksums (--no-ckpt-fallback: a mismatch
    would be an error)."""
    run = [*SHORT, *DP2_SHARDED]
    ckpt = str(tmp_path / "ckpt")
    term = torchrun_signalled_after("iteration        3/", signal.SIGTERM, [0, 1] if to == "ranks" else None, 2, *run,
                                    *(["--exit-signal-handler"] if to == "ranks" else []),
                                    "--save", ckpt, "--epp-metrics", str(tmp_path / "term.jsonl"), launcher=to == "launcher")
    assert term.returncode == 0 and term.ranks_left == 0, term.output[-4000:]
    stopped = int(re.search(r"exiting after iteration (\d+): SIGTERM received", term.output).group(1))
    print(f"SIGTERM to the {to} after iteration 3: saved iteration {stopped}, exit {term.returncode} after {term.seconds_to_exit:.1f} s")
    # the step in progress when the signal came (3, or 4 when it came after the ranks agreed on 3) is finished and
    # saved; through the launcher the signal reaches the ranks a moment later (its handler forwards it): a step or two
    assert (stopped in (3, 4) if to == "ranks" else 3 <= stopped < ITERS), term.output[-4000:]
    assert max(losses(tmp_path / "term.jsonl")) == stopped, term.output[-4000:]
    assert f"saved checkpoint at iteration {stopped} to" in term.output
    if to == "launcher":
        assert term.output.count("launch: SIGTERM: forwarded to the ranks") == 1, term.output[-4000:]
    resumed = torchrun(2, *run, "--load", ckpt, "--no-ckpt-fallback", "--epp-metrics", str(tmp_path / "resumed.jsonl")).stdout
    assert "dp=2 on " in resumed and f"resumed at iteration {stopped}" in resumed
    assert "warning: --load" not in resumed, resumed[-3000:]  # verified: nothing skipped, nothing unverified
    after = losses(tmp_path / "resumed.jsonl")
    assert sorted(after) == list(range(stopped + 1, ITERS + 1))
    assert all(after[i] == straight_dp2[i] for i in after), (after, straight_dp2)


def test_the_launcher_leaves_sigterm_to_the_ranks_of_a_run_that_saves():
    """megatron_epp.training.launch's torchrun command: --save adds --exit-signal-handler, and torchrun then
    handles every signal it would but SIGTERM; a run that does not save is torchrun's own command line."""
    torchrun_ = [sys.executable, "-m", "torch.distributed.run"]
    assert launch.torchrun_command(["--nproc-per-node", "2", "x.py", "--save", "d"]) == (
        [*torchrun_, "--nproc-per-node", "2", "--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT", "x.py", "--save", "d",
         "--exit-signal-handler"], True)
    assert launch.torchrun_command(["--signals_to_handle=SIGTERM,SIGUSR1", "x.py", "--save=d", "--exit-signal-handler"]) == (
        [*torchrun_, "--signals-to-handle", "SIGUSR1", "x.py", "--save=d", "--exit-signal-handler"], True)
    assert launch.torchrun_command(["--signals-to-handle", "SIGTERM", "x.py", "--exit-signal-handler"])[0][3:5] == [
        "--signals-to-handle", "SIGINT"]
    assert launch.torchrun_command(["--nproc-per-node=2", "x.py", "--lr", "1"]) == (
        [*torchrun_, "--nproc-per-node=2", "x.py", "--lr", "1"], False)


@pytest.mark.parametrize("fault", ["sigkill", "hang"])
def test_a_dead_or_hung_rank_ends_the_job(tmp_path, fault):
    """sigkill: rank 0 SIGKILLed after iteration 2; its peer's next p2p/collective fails on the closed
    connection, the survivor leaves (its --exit-signal-handler catches torchrun's SIGTERM and it still goes)
    and torchrun ends the job non-zero in seconds, no rank left.
    hang: rank 0 stops answering at iteration 3 (EPP_FAULT_INJECT=hang@3:0; alive, its connections open): its
    peer's receive times out after --distributed-timeout-minutes, and the job ends non-zero then, not later.
    Both end before torchrun's own 30 s grace between its SIGTERM and SIGKILL would have to end a rank."""
    timeout_s = 60 * HANG_TIMEOUT_MINUTES
    if fault == "sigkill":
        run = torchrun_signalled_after("iteration        2/", signal.SIGKILL, [0], 2, *SHORT, "--train-iters", "1000",
                                       "--exit-signal-handler", "--save", str(tmp_path / "ckpt"))
    else:
        run = torchrun_signalled_after("iteration        2/", signal.SIGKILL, [], 2, *SHORT, "--train-iters", "1000",
                                       "--distributed-timeout-minutes", str(HANG_TIMEOUT_MINUTES),
                                       env={"EPP_FAULT_INJECT": "hang@3:0"}, timeout=120)
    print(f"{fault} of rank 0: job exited {run.returncode} {run.seconds_to_exit:.1f} s after iteration 2")
    assert run.returncode != 0 and run.ranks_left == 0, run.output[-4000:]
    if fault == "sigkill":
        assert run.seconds_to_exit < KILL_BOUND_S, run.seconds_to_exit
    else:
        assert timeout_s <= run.seconds_to_exit < timeout_s + TORCHRUN_GRACE_S, run.seconds_to_exit


@pytest.mark.parametrize("fault, message", [
    ("nan_loss@3", "the loss is NaN/Inf at iteration 3 on rank 1"),
    ("nan_grad@3:0", "a gradient is NaN/Inf at iteration 3 on rank 0"),
])
def test_nan_stops_the_run_naming_the_iteration_and_the_rank(tmp_path, fault, message):
    proc = torchrun(2, *SHORT, "--train-iters", "4", "--check-for-nan-in-loss-and-grad", "--save", str(tmp_path / "ckpt"),
                    env={"EPP_FAULT_INJECT": fault}, check=False)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert ours == [f"pretrain_gpt.py: error: --check-for-nan-in-loss-and-grad: {message}; "
                    "stopped without updating the parameters"], proc.stderr[-4000:]
    assert sorted(losses(tmp_path / "ckpt" / "metrics.jsonl")) == [1, 2]  # iteration 3 was never logged
    assert not (tmp_path / "ckpt" / TRACKER).exists()  # nor saved


@pytest.fixture(scope="module")
def crashed_save(tmp_path_factory):
    """A run that saved iteration 3 and then crashed (rank 1) while saving iteration 6."""
    ckpt = tmp_path_factory.mktemp("crash") / "ckpt"
    proc = torchrun(2, *SHORT, "--train-iters", "6", "--save", str(ckpt), "--save-interval", "3",
                    env={"EPP_FAULT_INJECT": "crash_in_save@6:1"}, check=False)
    assert proc.returncode != 0 and "rank 1 crashes while saving iteration 6" in proc.stderr, proc.stderr[-3000:]
    return ckpt


def test_crash_during_save_leaves_the_previous_checkpoint_loadable(crashed_save, tmp_path):
    assert sorted(p.name for p in crashed_save.iterdir() if p.name.startswith("iter_")) == ["iter_0000003", "iter_0000006.tmp"]
    assert (crashed_save / TRACKER).read_text() == "3"
    ckpt = tmp_path / "ckpt"
    shutil.copytree(crashed_save, ckpt)
    # resumed on another data stream (--seed): allowed, with the one warning line of test_a_resume_on_other_data_...
    out = torchrun(2, *SHORT, "--train-iters", "100", "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "4",
                   "--exit-interval", "5", "--seed", "7").stdout
    assert "resumed at iteration 3" in out
    assert [line for line in out.splitlines() if "warning:" in line] == [
        f"> warning: --load {ckpt}: iteration 3 was trained on other data (--seed 1234 -> 7); training goes on at "
        "sample 24 of this run's stream, as in Megatron-LM: samples drawn before are not replayed or skipped by dataset, "
        "so some documents may repeat and others never come"], out[-3000:]
    assert [int(i) for i in re.findall(r"saved checkpoint at iteration (\d+)", out)] == [4, 5], out[-3000:]
    assert "exiting after iteration 5: --exit-interval 5" in out
    assert (ckpt / TRACKER).read_text() == "5"


def _args(load, *flags: str, base: list[str] = FLAGS):
    return parse_config([*base, "--load", str(load), *flags], world_size=2)


def _break(ckpt, how: str) -> None:
    it = ckpt / "iter_0000003"
    if how == "tracker":
        (ckpt / TRACKER).write_text("release")
    elif how == "no tracker":
        (ckpt / TRACKER).unlink()
    elif how == "wrong dir":
        (ckpt / TRACKER).write_text("5")
    elif how == "shard missing":
        next(it.glob("__1_*.distcp")).unlink()
    elif how == "shard short":
        shard = next(it.glob("__0_*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    elif how == "not ours":
        (it / METADATA).unlink()
    elif how == "renamed":
        it.rename(ckpt / "iter_0000002")
        (ckpt / TRACKER).write_text("2")


@pytest.mark.parametrize("how, flags, message", [
    ("tracker", [], "latest_checkpointed_iteration.txt holds 'release', not an iteration number"),
    ("no tracker", [], "no latest_checkpointed_iteration.txt beside iter_0000003"),
    ("wrong dir", ["--no-ckpt-fallback"], "names iteration 5, but"),
    ("shard missing", [], "missing file"),
    ("shard short", [], "bytes, saved with"),
    ("not ours", [], "is not a megatron-epp checkpoint"),
    ("renamed", [], "holds iteration 3, its name and latest_checkpointed_iteration.txt say 2"),
    (None, ["--hidden-size", "64"], "saved with --hidden-size 32, this run has 64 (a different model shape)"),
    (None, ["--pipeline-model-parallel-size", "1", "--use-distributed-optimizer"],
     "saved with --use-distributed-optimizer False, this run has True: the optimizer states do not convert between the two"),
])
def test_truncated_or_foreign_checkpoint_is_refused(crashed_save, tmp_path, how, flags, message):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(crashed_save, ckpt)
    if how:
        _break(ckpt, how)
    with pytest.raises(ArgumentError, match=re.escape(message)):
        check_loadable(_args(ckpt, *flags))
    assert check_loadable(_args(crashed_save)).candidates == [3]


def test_a_tracker_naming_a_missing_checkpoint_falls_back(crashed_save, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(crashed_save, ckpt)
    _break(ckpt, "wrong dir")
    resume = check_loadable(_args(ckpt))
    assert resume.candidates == [3] and len(resume.skipped) == 1 and "names iteration 5, but" in resume.skipped[0]


def test_bad_checkpoint_is_one_line_before_training(pretrain_in_process, crashed_save, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(crashed_save, ckpt)
    _break(ckpt, "shard missing")
    proc = pretrain_in_process(*FLAGS, "--load", str(ckpt), world_size=2)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(r"iter_0000003/__1_\d\.distcp: missing file$", lines[0]), proc.stderr


def test_a_resume_on_other_data_is_one_warning_line(crashed_save, tmp_path):
    """The checkpoint records its data stream: the --data-path blend (prefixes, normalised weights), the sampler's
    settings and position (consumed samples). Resuming on another blend or sampler setting is allowed, as in
    Megatron-LM (annealing on another mixture), with one warning line naming each change (main prints it: the
    crash test above resumes with another --seed)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(crashed_save, ckpt)
    meta_file = ckpt / "iter_0000003" / METADATA
    meta = json.loads(meta_file.read_text())
    assert meta["data"] == {"blend": None, "split": "969,30,1", "seed": 1234, "seq_length": 512, "global_batch_size": 8}
    assert meta["consumed_samples"] == 3 * 8
    assert data_change(_args(ckpt), 3) is None
    a, b = (write_corpus(tmp_path / name, [f"document {i} of {name}" for i in range(40)]) for name in ("a", "b"))
    on_data = [f for f in FLAGS if f != "--mock-data"]
    saved_on = _args(ckpt, "--data-path", "0.3", a, "0.7", b, base=on_data)
    meta["data"] = checkpoint_metadata(saved_on, 3)["data"]  # as if trained on 0.3 a 0.7 b
    meta["sha256"] = record_sha256(meta)
    meta_file.write_text(json.dumps(meta))
    assert meta["data"]["blend"] == {"prefixes": [a, b], "weights": [0.3, 0.7]}
    assert check_loadable(saved_on).candidates == [3] and data_change(saved_on, 3) is None
    assert data_change(_args(ckpt, "--data-path", "3", a, "7", b, base=on_data), 3) is None  # the same normalised blend
    tail = "; training goes on at sample 24 of this run's stream, as in Megatron-LM"
    note = data_change(_args(ckpt, "--data-path", "0.5", a, "0.5", b, "--global-batch-size", "4", base=on_data), 3)
    assert note.startswith(f"warning: --load {ckpt}: iteration 3 was trained on other data (--data-path blend of 0.3 {a}, "
                           f"0.7 {b} -> blend of 0.5 {a}, 0.5 {b}; --global-batch-size 8 -> 4){tail}"), note
    note = data_change(_args(ckpt, "--data-path", a, base=on_data), 3)
    assert f"(--data-path blend of 0.3 {a}, 0.7 {b} -> {a}){tail}" in note, note
    note = data_change(_args(ckpt, "--seed", "7", "--seq-length", "256"), 3)
    assert f"(--data-path blend of 0.3 {a}, 0.7 {b} -> --mock-data; --seed 1234 -> 7; --seq-length 512 -> 256){tail}" in note, note
    assert "\n" not in note


def test_empty_or_missing_load_directory_starts_from_scratch(tmp_path):
    assert check_loadable(_args(tmp_path)) is None  # --load = --save on a job's first run
    assert check_loadable(_args(tmp_path / "not-yet")) is None  # (tests/integration/test_checkpoint_integrity.py: its warning)


@pytest.mark.parametrize("how, message", [
    ("bin short", "bytes, but {p}.idx describes"),
    ("magic", "not a Megatron indexed-dataset index (bad magic)"),
    ("dtype", "unknown token dtype code 99"),
    ("idx short", "its header (30 sequences, 31 document bounds) needs"),
])
def test_bin_and_idx_that_do_not_match_are_one_line(pretrain_in_process, tmp_path, how, message):
    prefix = write_corpus(tmp_path / "corpus", ["some text of a document"] * 30)
    idx, bin_ = tmp_path / "corpus.idx", tmp_path / "corpus.bin"
    if how == "bin short":
        bin_.write_bytes(bin_.read_bytes()[:-10])
    elif how == "magic":
        idx.write_bytes(b"NOTANIDX!" + idx.read_bytes()[9:])
    elif how == "dtype":
        data = bytearray(idx.read_bytes())
        data[17] = 99
        idx.write_bytes(bytes(data))
    elif how == "idx short":
        idx.write_bytes(idx.read_bytes()[:-8])
    flags = ["--num-layers", "4", "--data-path", prefix, "--split", "1,0,0", "--seq-length", "16"]
    if how == "bin short":  # what pretrain_gpt.py prints, once; the other cases through check_corpus
        proc = pretrain_in_process(*flags)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message.format(p=prefix) in lines[0], proc.stderr
    else:
        with pytest.raises(ArgumentError, match=re.escape(message.format(p=prefix))):
            check_corpus(parse_config(flags, world_size=1))


def test_exit_flags_are_checked():
    for flags, message in ((["--exit-signal-handler"], "--exit-signal-handler needs --save"),
                           (["--exit-interval", "0"], "--exit-interval 0: must be >= 1"),
                           (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes 0.0: must be > 0")):
        with pytest.raises(ArgumentError, match=re.escape(message)):
            parse_config([*FLAGS, *flags], world_size=2)


def test_exit_conditions_in_one_process():
    """--exit-interval, --exit-duration-in-mins and the SIGTERM flag, as one rank decides them (the
    SIGTERM test above has two ranks agree)."""
    init_single_process()
    args = argparse.Namespace(exit_interval=4, exit_duration_in_mins=None, exit_signal_handler=True)
    exits = ExitConditions(args, torch.device("cpu"), start_time=time.time())
    try:
        assert [exits.reason(i) for i in (1, 2, 3)] == [None] * 3
        assert exits.reason(4) == "--exit-interval 4"
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits.reason(5) == "SIGTERM received (--exit-signal-handler)"
    finally:
        exits.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    args = argparse.Namespace(exit_interval=None, exit_duration_in_mins=0.5, exit_signal_handler=False)
    assert ExitConditions(args, torch.device("cpu"), start_time=time.time() - 20).reason(1) is None
    late = ExitConditions(args, torch.device("cpu"), start_time=time.time() - 40).reason(1)
    assert late is not None and late.endswith("minutes elapsed (--exit-duration-in-mins 0.5)"), late


def test_waiting_for_a_line_ends_at_its_deadline_when_the_job_hangs_silently():
    """The harness of the signal tests: a job that prints nothing more is killed at the deadline and the
    wait fails then (it used to check its deadline only when a line arrived: a silent hang stalled CI)."""
    import subprocess
    import sys
    import time

    import pytest

    from tests.launch import _read_until

    proc = subprocess.Popen([sys.executable, "-c", "print('started', flush=True); import time; time.sleep(120)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    start = time.monotonic()
    with pytest.raises(AssertionError, match="no line starting 'iteration' within 1 s"):
        _read_until(proc, "iteration", 1.0)
    assert time.monotonic() - start < 20
    assert proc.wait(timeout=10) == -9  # killed by the deadline, not left running


@pytest.mark.parametrize("launcher", ["forked", "torchrun"])
def test_the_fault_line_is_written_before_any_rank_exits(monkeypatch, launcher):
    """A :class:`TrainingFault` on every rank, the logging rank the slowest to reach its line by 2 s: whatever the
    launcher, the other rank's exit 1 (which makes the launcher stop the rest) comes after the line, so it is there, once.
    The planted fault (``report_fault`` without its barrier) loses the line in both launchers."""
    monkeypatch.setenv("EPP_TEST_LAUNCHER", launcher)
    proc = torchrun(2, "tests/workers/fault_line.py", env={"EPP_TEST_LOGGING_DELAY_S": "2"}, check=False, timeout=120)
    assert proc.returncode != 0
    assert [l for l in proc.stderr.splitlines() if l.startswith("pretrain_gpt.py: error:")] == [
        "pretrain_gpt.py: error: a planted fault"], proc.stderr[-3000:]
