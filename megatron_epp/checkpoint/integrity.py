"""Loading trusts nothing it has not verified. :func:`check_loadable` (before any process group exists, on every
rank: reads only ``epp_metadata.json`` and the files' sizes) refuses a foreign checkpoint (another model shape, or a
layout its optimizer states cannot reshard to: :class:`~megatron_epp.checkpoint.reshard.Reshard`) and picks the
candidates: the tracker's iteration, then (unless ``--no-ckpt-fallback``) the older ones; a candidate whose metadata is
damaged or whose files are missing or of another size is skipped with one warning line. :func:`choose_verified`
(collective, after the process group exists) checks the candidates' checksums, newest first, before megatron-core reads
any file: each rank hashes the files its own rank number wrote (``__R_*.distcp``, at another world size R modulo it;
rank 0 the shared ones), the files a rank reads back on a load of the same layout, so the whole checkpoint is read once,
by all ranks in parallel (one rank hashing all of it would take world-size times longer; every rank hashing all of it
would read it world-size times). A damaged checkpoint is one line naming the file, or with the fallback one warning
line and the next older one. A checkpoint saved before checksums were recorded (``megatron-epp checkpoint 1``) is
refused in one line."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from megatron_epp.checkpoint.records import (
    FINETUNE_FREE,
    FORMAT,
    METADATA,
    PADDING_ARGS,
    TRACKER,
    CheckpointError,
    checkpoint_metadata,
    iteration_dir,
    read_metadata,
)
from megatron_epp.checkpoint.reshard import Reshard
from megatron_epp.config.errors import ArgumentError
from megatron_epp.config.fields import TrainingConfig
from megatron_epp.model.gpt import pad_vocab, padded_vocab_size
from megatron_epp.model.runtime import Runtime


def sha256_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def record_sha256(meta: dict[str, Any]) -> str:
    """The checksum of ``epp_metadata.json``'s record (all but this field), over its canonical JSON."""
    body = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


_WRITER = re.compile(r"__(\d+)_\d+\.distcp")


def hashed_by(name: str, rank: int, world_size: int) -> bool:
    """Whether ``rank`` hashes the checkpoint file ``name`` (every file exactly one rank of ``world_size``): the
    ``__R_*.distcp`` files the rank R wrote (at save still in its page cache; on a load of the same layout the shards R
    reads), those of a writer rank this world lacks (a load at a smaller layout) rank R modulo the world size; the
    shared files rank 0."""
    match = _WRITER.fullmatch(name)
    return (int(match.group(1)) % world_size if match else 0) == rank


def _file_problem(path: str, name: str, expected: dict[str, Any]) -> str | None:
    """What is wrong with the checkpoint file ``name`` against its record (``bytes``, ``sha256``), None if it is whole."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        return f"{name}: missing file"
    size = os.path.getsize(file)
    if size != expected["bytes"]:
        return f"{name}: {size} bytes, saved with {expected['bytes']}"
    if "sha256" in expected and sha256_of(file) != expected["sha256"]:
        return f"{name}: checksum mismatch (sha256 differs from the one recorded at save)"
    return None


@dataclass
class Resume:
    """What :func:`check_loadable` found in ``--load``: the checkpoints that passed its checks, newest first (the
    tracker's iteration, then with the fallback the older ones), and what is wrong with each one it skipped."""

    root: str
    candidates: list[int]
    skipped: list[str] = field(default_factory=list)


def check_loadable(cfg: TrainingConfig) -> Resume | None:
    """The checkpoints ``--load`` may resume from, None when there is none yet (a first run with ``--load`` =
    ``--save``, the directory not yet created or empty); :class:`ArgumentError` (one line) when it cannot be
    loaded: a foreign checkpoint (another model shape or layout), a bad tracker, or (without the fallback: the
    tracker's checkpoint; with it: every one) a damaged or truncated checkpoint. Reads the metadata and the files'
    sizes only; :func:`choose_verified` checks the checksums."""
    root = cfg.checkpoint.load
    where = f"--load {root}"
    tracker = os.path.join(root, TRACKER)
    committed = sorted((int(d[5:]) for d in os.listdir(root) if re.fullmatch(r"iter_\d{7}", d)), reverse=True) if os.path.isdir(root) else []
    if not os.path.isfile(tracker):
        if committed:
            names = ", ".join(os.path.basename(iteration_dir(root, i)) for i in reversed(committed))
            raise ArgumentError(f"{where}: no {TRACKER} beside {names} (a truncated checkpoint directory)")
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ArgumentError(f"{where}: {TRACKER} holds {text[:40]!r}, not an iteration number")
    latest = int(text)
    order = [latest] + ([i for i in committed if i < latest] if cfg.checkpoint.ckpt_fallback else [])
    resume = Resume(root, [])
    for iteration in order:
        try:
            problem = _checkpoint_problem(cfg, iteration)
        except ArgumentError as error:  # another model shape or layout: an error for the latest, else not a fallback
            if iteration == latest:
                raise
            problem = str(error).split(f"{where}: ", 1)[1]
        if problem is None:
            resume.candidates.append(iteration)
        elif not cfg.checkpoint.ckpt_fallback:
            raise ArgumentError(f"{where}: {problem}")
        else:
            resume.skipped.append(problem)
    if not resume.candidates:
        raise ArgumentError(f"{where}: no checkpoint can be loaded: {'; '.join(resume.skipped)}")
    return resume


def skip_note(root: str, problem: str) -> str:
    """The warning line of a checkpoint the fallback skipped."""
    return f"warning: --load {root}: skipped, {problem}; falling back to the previous checkpoint"


def _checkpoint_problem(cfg: TrainingConfig, iteration: int) -> str | None:
    """Why ``--load``'s ``iteration`` cannot be loaded, as far as its metadata and its files' sizes tell; None if
    they are whole. A checkpoint of another model shape or layout raises :class:`ArgumentError`: that is no damage
    an older checkpoint would mend."""
    path = iteration_dir(cfg.checkpoint.load, iteration)
    if not os.path.isdir(path):
        return f"{TRACKER} names iteration {iteration}, but {path} does not exist"
    if not os.path.isfile(os.path.join(path, METADATA)):
        return f"{path} is not a megatron-epp checkpoint (no {METADATA})"
    meta = read_metadata(path)
    if not isinstance(meta, dict):
        return f"{path}/{METADATA}: damaged (not valid JSON)"
    if not str(meta.get("format")).startswith("megatron-epp checkpoint"):
        return f"{path} is not a megatron-epp checkpoint (no valid {METADATA})"
    if meta["format"] != FORMAT:  # "megatron-epp checkpoint 1": saved before the files' checksums were recorded
        raise ArgumentError(f"--load {cfg.checkpoint.load}: iteration {iteration} is a {meta['format']!r}, saved by an "
                            f"older megatron-epp without its files' checksums; this version loads {FORMAT!r} only")
    if meta.get("sha256") != record_sha256(meta):
        return f"{path}/{METADATA}: checksum mismatch (its record was changed after save)"
    if meta.get("iteration") != iteration:
        return f"{path} holds iteration {meta.get('iteration')}, its name and {TRACKER} say {iteration}"
    saved_model = meta.get("model", {})
    free = [k for k in FINETUNE_FREE if k != "max_position_embeddings" or cfg.model.position_embedding_type == "rope"] \
        if cfg.checkpoint.finetune else ()
    padded = saved_model.get("padded_vocab_size") or pad_vocab(
        saved_model.get("vocab_size"), saved_model.get("make_vocab_size_divisible_by"), meta.get("layout", {}).get("tensor_model_parallel_size", 1))
    if padded != padded_vocab_size(cfg):
        raise ArgumentError(f"--load {cfg.checkpoint.load}: iteration {iteration} {_vocab_padding(cfg, padded)}")
    for key, want in checkpoint_metadata(cfg, iteration)["model"].items():
        if key in PADDING_ARGS:  # the padded vocabulary is the shape (the flag times tp: it may change with tp)
            continue
        if key in saved_model and saved_model[key] != want and key not in free:  # a flag the checkpoint's version did not record: not compared
            raise ArgumentError(
                f"--load {cfg.checkpoint.load}: iteration {iteration} was saved with --{key.replace('_', '-')} {meta['model'][key]}, "
                f"this run has {want} (a different model shape)"
            )
    layout_problem = Reshard.of(cfg, meta).problem(cfg)  # another layout loads (resharded), but for these optimizer states
    if layout_problem:
        raise ArgumentError(f"--load {cfg.checkpoint.load}: iteration {iteration} was {layout_problem}")
    for name, record in meta["files"].items():
        problem = _file_problem(path, name, {"bytes": record["bytes"]})  # sizes here; checksums in choose_verified
        if problem:
            return f"{path}/{problem}"
    return None


def _vocab_padding(cfg: TrainingConfig, saved: int) -> str:
    """The refusal of a checkpoint whose output layer is padded to ``saved`` rows, not this run's, and the
    ``--make-vocab-size-divisible-by`` that pads this run's vocabulary to them at its tensor-parallel size, if any."""
    tp = cfg.parallel.dims.tp
    fits = [d for d in range(saved // tp, 0, -1) if pad_vocab(cfg.model.vocab_size, d, tp) == saved]
    return (f"has its vocabulary padded to {saved} rows, this run pads it to {padded_vocab_size(cfg)} (--make-vocab-size-divisible-by "
            f"{cfg.model.make_vocab_size_divisible_by} x tp {tp}): a different model shape (the padded rows enter the softmax)"
            + (f"; --make-vocab-size-divisible-by {fits[0]} pads it to {saved} at tp {tp}" if fits else ""))


def choose_verified(cfg: TrainingConfig, resume: Resume, runtime: Runtime) -> tuple[int, list[str]]:
    """Collective: the newest of ``resume``'s candidates whose files match their checksums, and the warning lines
    (one per checkpoint skipped, here or by :func:`check_loadable`); :class:`CheckpointError` (one line,
    the same on every rank) when the tracker's checkpoint is damaged and ``--no-ckpt-fallback`` is given, or none
    verifies. Each rank hashes the files :func:`hashed_by` gives it; the ranks then share what they found."""
    skipped = list(resume.skipped)
    for iteration in resume.candidates:
        path = iteration_dir(resume.root, iteration)
        meta = read_metadata(path)
        notes = [skip_note(resume.root, problem) for problem in skipped]
        mine = [_file_problem(path, name, record) for name, record in meta["files"].items()
                if hashed_by(name, runtime.rank, runtime.world_size)]
        found: list[list[str | None] | None] = [None] * runtime.world_size
        dist.all_gather_object(found, mine)
        problems = sorted(p for part in found for p in part if p)
        if not problems:
            return iteration, notes
        if not cfg.checkpoint.ckpt_fallback:
            raise CheckpointError(f"pretrain_gpt.py: error: --load {resume.root}: {path}/{problems[0]}")
        skipped.append(f"{path}/{problems[0]}")
    raise CheckpointError(f"pretrain_gpt.py: error: --load {resume.root}: no checkpoint verifies: {'; '.join(skipped)}")
