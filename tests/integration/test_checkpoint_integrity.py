"""Checkpoints that cannot be trusted are never loaded (pretrain_gpt.py, torchrun pp=2, tiny model).

Every file of a checkpoint has its size and SHA-256 in epp_metadata.json (itself checksummed); a same-size byte
flip in any kind of file (.distcp shards, torch's .metadata, megatron-core's metadata.json and common.pt,
epp_metadata.json) is found before megatron-core reads anything: one line naming the file with
--no-ckpt-fallback, else one warning line and the previous checkpoint, which then trains exactly as a run
resumed from it directly. Also: the bias flag is part of the model shape; --load of a directory with no
checkpoint yet starts from scratch with one warning; --finetune loads the weights only."""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest

from megatron_epp.measure.layer_bench import init_single_process
from megatron_epp.config.parser import parse_config
from megatron_epp.config.errors import ArgumentError
from megatron_epp.checkpoint.integrity import check_loadable, choose_verified, skip_note
from megatron_epp.checkpoint.records import METADATA, TRACKER, CheckpointError
from tests.launch import logged_losses, torchrun
from tests.integration.test_faults import FLAGS, SHORT

# one rank hashing every file: what the ranks of a job share out (megatron_epp.checkpoint.checkpointing.hashed_by)
ONE_RANK = SimpleNamespace(rank=0, world_size=1)
KINDS = ["__1_0.distcp", ".metadata", "metadata.json", "common.pt", METADATA]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """--save X --load X with X not yet there (a job's first run) of 6 iterations, stopped after 4: iterations 2
    and 4 saved; its log."""
    ckpt = tmp_path_factory.mktemp("integrity") / "ckpt"
    out = torchrun(2, *SHORT, "--train-iters", "6", "--exit-interval", "4", "--save", str(ckpt), "--load", str(ckpt),
                   "--save-interval", "2").stdout
    return ckpt, out


def test_a_first_run_with_load_equal_to_save_starts_from_scratch_with_one_warning(saved):
    ckpt, out = saved
    assert [line for line in out.splitlines() if "warning" in line] == [
        f"> warning: --load {ckpt}: no checkpoint there yet (no such directory); starting from scratch at iteration 0"], out[-3000:]
    assert sorted(logged_losses(out)) == [1, 2, 3, 4]
    assert (ckpt / TRACKER).read_text() == "4"
    files = json.loads((ckpt / "iter_0000004" / METADATA).read_text())["files"]
    assert sorted(files) == sorted(p.name for p in (ckpt / "iter_0000004").iterdir() if p.name != METADATA)
    assert set(KINDS) - {METADATA} <= set(files)


def _flip(file) -> None:
    """Overwrite bytes in the middle of ``file`` with others (the same size): 64 of them, or a quarter of a small file."""
    data = bytearray(file.read_bytes())
    n = min(64, len(data) // 4)
    at = len(data) // 2
    data[at:at + n] = bytes(b ^ 0x5A for b in data[at:at + n])
    file.write_bytes(bytes(data))


def _verdict(ckpt, *flags):
    """What --load does before megatron-core reads a file: (iteration, warning lines), or the one-line error."""
    args = parse_config([*FLAGS, "--load", str(ckpt), *flags], world_size=2)
    init_single_process()
    try:
        resume = check_loadable(args)
        return choose_verified(args, resume, ONE_RANK)
    except (ArgumentError, CheckpointError) as error:
        return str(error)


@pytest.mark.parametrize("kind", KINDS)
def test_a_byte_flip_in_any_file_is_caught_before_loading(saved, tmp_path, kind):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[0], ckpt)
    assert _verdict(ckpt) == (4, [])
    damaged = ckpt / "iter_0000004" / kind
    size = damaged.stat().st_size
    _flip(damaged)
    assert damaged.stat().st_size == size
    error = _verdict(ckpt, "--no-ckpt-fallback")
    assert isinstance(error, str) and "\n" not in error, error
    assert error.startswith(f"pretrain_gpt.py: error: --load {ckpt}: {damaged}: "), error
    assert re.search("checksum mismatch|not valid JSON", error) and "weights_only" not in error, error
    iteration, notes = _verdict(ckpt)
    assert iteration == 2 and notes == [skip_note(str(ckpt), error.split(f"--load {ckpt}: ", 1)[1])], notes
    assert notes[0].startswith(f"warning: --load {ckpt}: skipped, {damaged}: ")


def test_missing_or_resized_files_are_caught_and_all_damaged_is_an_error(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[0], ckpt)
    (ckpt / "iter_0000004" / "common.pt").unlink()
    shard = ckpt / "iter_0000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes() + b"\0")
    assert _verdict(ckpt, "--no-ckpt-fallback") == f"pretrain_gpt.py: error: --load {ckpt}: {ckpt}/iter_0000004/common.pt: missing file"
    size = shard.stat().st_size
    assert _verdict(ckpt) == (
        f"pretrain_gpt.py: error: --load {ckpt}: no checkpoint can be loaded: {ckpt}/iter_0000004/common.pt: missing file; "
        f"{shard}: {size} bytes, saved with {size - 1}")


def test_a_checkpoint_saved_before_checksums_is_refused_in_one_line(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[0], ckpt)
    meta_file = ckpt / "iter_0000004" / METADATA
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**{k: v for k, v in meta.items() if k not in ("files", "sha256")},
                                     "format": "megatron-epp checkpoint 1"}))
    assert _verdict(ckpt) == (
        f"pretrain_gpt.py: error: --load {ckpt}: iteration 4 is a 'megatron-epp checkpoint 1', saved by an older megatron-epp without its "
        "files' checksums; this version loads 'megatron-epp checkpoint 2' only")


def test_the_bias_flag_is_part_of_the_model_shape(saved):
    assert _verdict(saved[0], "--disable-bias-linear") == (
        f"pretrain_gpt.py: error: --load {saved[0]}: iteration 4 was saved with --disable-bias-linear False, this run has "
        "True (a different model shape)")


def test_load_flags_are_checked():
    for flags, message in ((["--ckpt-format", "torch"], "--ckpt-format torch: megatron-epp saves and loads torch_dist only"),
                           (["--no-load-optim"], "--no-load-optim needs --load"),
                           (["--finetune"], "--finetune needs --load")):
        with pytest.raises(ArgumentError, match=re.escape(message)):
            parse_config([*FLAGS, *flags], world_size=2)
    assert parse_config([*FLAGS, "--ckpt-format", "torch_dist"], world_size=2).checkpoint.ckpt_format == "torch_dist"


def test_the_fallback_trains_as_a_resume_from_the_previous_checkpoint(saved, tmp_path):
    """A damaged shard of iteration 4: one warning line naming it, and iterations 3 and 4 have the losses of the
    first run, which trained them from iteration 2's state (a resume is bit-identical to the run it resumes:
    tests/integration/test_faults.py; so a direct resume from iteration 2 has those losses too: one launch less); with
    --no-ckpt-fallback the job stops with one line naming the file."""
    fallback = tmp_path / "fallback"
    shutil.copytree(saved[0], fallback)
    damaged = fallback / "iter_0000004" / "__1_0.distcp"
    _flip(damaged)
    fell_back = torchrun(2, *SHORT, "--train-iters", "6", "--exit-interval", "4", "--load", str(fallback)).stdout
    assert "resumed at iteration 2" in fell_back, fell_back[-3000:]
    assert [line for line in fell_back.splitlines() if "warning" in line] == [
        f"> warning: --load {fallback}: skipped, {damaged}: checksum mismatch (sha256 differs from the one recorded at "
        "save); falling back to the previous checkpoint"], fell_back[-3000:]
    first = logged_losses(saved[1])
    assert logged_losses(fell_back) == {3: first[3], 4: first[4]}, (logged_losses(fell_back), first)
    stopped = torchrun(2, *SHORT, "--train-iters", "6", "--load", str(fallback), "--no-ckpt-fallback", check=False)
    assert stopped.returncode != 0 and not logged_losses(stopped.stdout)
    ours = [line for line in stopped.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert ours == [f"pretrain_gpt.py: error: --load {fallback}: {damaged}: checksum mismatch (sha256 differs from the "
                    "one recorded at save)"], stopped.stderr[-3000:]


def test_finetune_loads_the_weights_only(saved):
    """--finetune: the trained weights (a first loss below the first run's), iteration 0, no optimizer state."""
    out = torchrun(2, *SHORT, "--train-iters", "4", "--exit-interval", "1", "--load", str(saved[0]), "--finetune").stdout
    assert "--finetune: weights of iteration 4, starting at iteration 0" in out, out[-3000:]
    first, trained = logged_losses(out), logged_losses(saved[1])
    assert sorted(first) == [1] and float(first[1]) < float(trained[1]), (first, trained)
