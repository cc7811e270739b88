"""Hugging Face LLaMA, Mistral, Qwen2 and Qwen3 checkpoints in and out of megatron-epp (what Megatron-LM's
``tools/checkpoint/convert.py`` does).

    python -m megatron_epp.checkpoint.hf_convert flags --hf-dir HF [--tensor-model-parallel-size T]
    torchrun --nproc-per-node T*P -m megatron_epp.checkpoint.hf_convert import --hf-dir HF --save DIR \\
        --tensor-model-parallel-size T --pipeline-model-parallel-size P
    torchrun --nproc-per-node T*P -m megatron_epp.checkpoint.hf_convert export --load DIR --hf-dir OUT \
        [--model-type llama|mistral|qwen2|qwen3] [--bf16 | --fp16 | --fp32] [--tokenizer-model DIR]

``flags`` prints the ``pretrain_gpt.py`` flag line the Hugging Face model implies. ``import`` writes a megatron-epp
checkpoint (iteration 0, model weights only) at T x P, which ``pretrain_gpt.py <those flags> --load DIR --finetune``
loads: every rank builds its stage's part of megatron-core's GPTModel, reads its slices of the ``*.safetensors``
tensors one by one, and the repository's checkpoint writer saves them (dist_checkpointing, checksummed). ``export``
loads a checkpoint's model weights (verified against its checksums) at T x P (launched with as many ranks; by
default the layout it was saved at, any data-parallel size) and writes one ``*.safetensors`` file per pipeline
stage, the index and a ``config.json`` (the family, the run's context length, RoPE base and scaling) that
``transformers`` loads, in the precision the run trained in (``--bf16`` writes bf16 tensors, as a bf16 model was
imported); the tokenizer's files (``tokenizer.json``, ``tokenizer_config.json`` with its chat template, ...) are
copied beside them from the run's ``--tokenizer-model`` (the import's directory, which the import's flag line names):
the directory is what a user uploads. Bad input is one line, before any rank starts work.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from typing import Sequence

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from megatron_epp.checkpoint import integrity, records, store
from megatron_epp.checkpoint.hf_llama import (
    DTYPES,
    FAMILIES,
    INDEX,
    PRECISION_FLAGS,
    HFCheckpointError,
    LlamaSpec,
    ShardReader,
    flags_from_record,
    gather_order,
    hf_config,
    hf_tensors,
    implied_flags,
    megatron_tensor,
    read_spec,
    record_family,
    spec_from_record,
)
from megatron_epp.config.errors import ArgumentError
from megatron_epp.config.parser import parse_config, world_size_from_env
from megatron_epp.model.gpt import build_model, padded_vocab_size
from megatron_epp.model.runtime import initialize, shutdown

PROG = "epp-hf-convert"  # its errors' name, however it is run (python -m megatron_epp.checkpoint.hf_convert)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG)
    sub = p.add_subparsers(dest="command", required=True)
    flags = sub.add_parser("flags", help="print the pretrain_gpt.py flags a Hugging Face LLaMA implies")
    imp = sub.add_parser("import", help="a Hugging Face LLaMA to a megatron-epp checkpoint (under torchrun, T x P ranks)")
    for q in (flags, imp):
        q.add_argument("--hf-dir", required=True, help="config.json + *.safetensors (+ tokenizer.json)")
        q.add_argument("--tensor-model-parallel-size", type=int, default=1)
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    imp.add_argument("--save", required=True, help="the megatron-epp checkpoint directory to write")
    exp = sub.add_parser("export", help="a megatron-epp checkpoint to a Hugging Face directory (under torchrun)")
    exp.add_argument("--load", required=True, help="a megatron-epp checkpoint directory (its latest iteration)")
    exp.add_argument("--hf-dir", required=True, help="the Hugging Face directory to write")
    exp.add_argument("--tensor-model-parallel-size", type=int, default=None, help="default: the checkpoint's")
    exp.add_argument("--pipeline-model-parallel-size", type=int, default=None, help="default: the checkpoint's")
    exp.add_argument("--model-type", choices=tuple(FAMILIES), default=None,
                     help="the family config.json names (default: the family the checkpoint's weights were imported from, "
                          "else qwen3 with --qk-layernorm, qwen2 with --add-qkv-bias, else llama)")
    precision = exp.add_mutually_exclusive_group()
    for flag, dtype in (("--bf16", "bfloat16"), ("--fp16", "float16"), ("--fp32", "float32")):
        precision.add_argument(flag, dest="dtype", action="store_const", const=dtype,
                               help=f"write {dtype} tensors (default: the precision the checkpoint's run trained in)")
    exp.add_argument("--tokenizer-model", default=None, metavar="DIR",
                     help="the Hugging Face tokenizer whose files are copied beside the model (default: the checkpoint's "
                          "run's --tokenizer-model, where its --tokenizer-type is HuggingFaceTokenizer)")
    return p


# A Hugging Face tokenizer's files (and the generation defaults a model directory carries): what export copies
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def tokenizer_flags(hf_dir: str) -> list[str]:
    """The tokenizer flags of a Hugging Face directory with a ``tokenizer.json``, else none."""
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir] if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")) else []


def flag_line(spec: LlamaSpec, hf_dir: str, tp: int) -> str:
    return "pretrain_gpt.py " + shlex.join(implied_flags(spec, tp) + tokenizer_flags(hf_dir))


def _layer(gpt: torch.nn.Module, name: str) -> int | None:
    """The global layer index of a parameter of this stage's ``decoder.layers.<i>`` (None outside the layers)."""
    parts = name.split(".")
    return gpt.decoder.layers[int(parts[2])].layer_number - 1 if parts[:2] == ["decoder", "layers"] else None


def import_checkpoint(args: argparse.Namespace) -> int:
    """``import``: checks the directory (config.json, every tensor's shape from the headers) before any work."""
    spec = read_spec(args.hf_dir)
    reader = ShardReader(args.hf_dir)
    reader.check(spec)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    # the tokenizer too: the checkpoint records it, and an export copies its files beside the model
    cfg = parse_config(implied_flags(spec, tp) + tokenizer_flags(args.hf_dir) + ["--mock-data", "--save", args.save,
                                                                                 "--tensor-model-parallel-size", str(tp),
                                                                                 "--pipeline-model-parallel-size", str(pp)])
    runtime = initialize(cfg)
    if runtime.rank == 0:
        print(f"> {flag_line(spec, args.hf_dir, tp)}", flush=True)
    model, _ = build_model(cfg, runtime)
    gpt = unwrap_model(model)
    padded = padded_vocab_size(cfg)
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            param.copy_(megatron_tensor(reader, spec, name, _layer(gpt, name), tp, runtime.tp_rank, padded))
    path = store.save_checkpoint(cfg, model, None, None, runtime, 0, 0, origin={"model_type": spec.model_type})
    if runtime.rank == 0:
        print(f"> imported {args.hf_dir} into {path} (tp {tp}, pp {pp}): load it with --load {args.save} --finetune", flush=True)
    return 0


def _export_config(args: argparse.Namespace):
    """The checkpoint's model as ``pretrain_gpt.py``'s config at its own layout and at the export's, and its LLaMA spec
    (one line if it is none)."""
    iteration_file = os.path.join(args.load, records.TRACKER)
    if not os.path.isfile(iteration_file):
        raise ArgumentError(f"--load {args.load}: no megatron-epp checkpoint ({records.TRACKER} missing)")
    with open(iteration_file) as f:
        meta_path = os.path.join(records.iteration_dir(args.load, int(f.read().strip())), records.METADATA)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        raise ArgumentError(f"--load {args.load}: {meta_path} missing or damaged") from None
    saved_dtype = meta.get("params_dtype", "float32")  # a checkpoint from before the record: fp32
    tokenizer = export_tokenizer(args, meta)
    spec = spec_from_record(meta["model"], args.model_type or origin_family(meta), args.dtype or saved_dtype)
    layout = meta["layout"]
    tp = args.tensor_model_parallel_size or layout["tensor_model_parallel_size"]
    pp = args.pipeline_model_parallel_size or layout["pipeline_model_parallel_size"]
    world = world_size_from_env()
    if world % (tp * pp):
        raise ArgumentError(f"export at tp {tp} x pp {pp}: launched with {world} ranks (a multiple of {tp * pp} needed)")
    precision = [PRECISION_FLAGS[saved_dtype]] if saved_dtype in PRECISION_FLAGS else []  # the model as it was trained

    def config(tp: int, pp: int, world: int):
        return parse_config(flags_from_record(meta["model"]) + precision + ["--mock-data", "--load", args.load, "--finetune",
                                                                            "--tensor-model-parallel-size", str(tp),
                                                                            "--pipeline-model-parallel-size", str(pp)], world_size=world)

    # checked at the layout it was saved at; loaded at the export's (megatron-core's sharded model state reshards)
    saved = (layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"])
    return config(*saved, saved[0] * saved[1]), config(tp, pp, world), spec, tokenizer


def export_tokenizer(args: argparse.Namespace, meta: dict) -> str | None:
    """The directory whose tokenizer files export copies: ``--tokenizer-model``, else the checkpoint's run's Hugging Face
    tokenizer (its directory, or the directory of its ``tokenizer.json``); None where the run had none. One line for a
    ``--tokenizer-model`` that holds no tokenizer; a warning where the recorded one is gone (the model is still exported)."""
    if args.tokenizer_model is not None:
        if not os.path.isfile(os.path.join(args.tokenizer_model, "tokenizer.json")):
            raise ArgumentError(f"--tokenizer-model {args.tokenizer_model}: no tokenizer.json there")
        return args.tokenizer_model
    recorded = meta.get("tokenizer") or {}
    path = recorded.get("model") if recorded.get("type") == "HuggingFaceTokenizer" else None
    if path is None:
        return None
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        print(f"{PROG}: warning: the checkpoint's tokenizer {path} is gone: no tokenizer files are written (give --tokenizer-model DIR)",
              file=sys.stderr, flush=True)
        return None
    return directory


def origin_family(meta: dict) -> str | None:
    """The family the checkpoint's weights were imported from (its ``hf_origin`` record) where its model still is one
    (a LLaMA layer named Mistral); else None: :func:`record_family` tells from the model record."""
    model_type, found = (meta.get("hf_origin") or {}).get("model_type"), record_family(meta["model"])
    return model_type if model_type == found or (model_type, found) == ("mistral", "llama") else None


def copy_tokenizer(source: str, hf_dir: str) -> list[str]:
    """Copy ``source``'s tokenizer files (:data:`TOKENIZER_FILES`) into ``hf_dir``; the names copied."""
    copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
    for name in copied:
        shutil.copyfile(os.path.join(source, name), os.path.join(hf_dir, name))
    return copied


def _gathered(param: torch.nn.Parameter, name: str, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """The whole parameter, its tensor-parallel shards gathered over ``tp_group`` (every rank of the group gets it)."""
    tp = tp_group.size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    shards = [torch.empty_like(param) for _ in range(tp)]
    dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
    return gather_order(name, torch.cat(shards, dim=param.partition_dim), tp)


def export_checkpoint(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    saved_cfg, cfg, spec, tokenizer = _export_config(args)
    resume = integrity.check_loadable(saved_cfg)
    if resume is None:
        raise ArgumentError(f"--load {args.load}: no checkpoint there")
    runtime = initialize(cfg)
    iteration, _ = integrity.choose_verified(cfg, resume, runtime)
    model, _ = build_model(cfg, runtime)
    store.load_model_weights(cfg, iteration, model, runtime)
    gpt = unwrap_model(model)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in gpt.named_parameters():
        full = _gathered(param, name, runtime.pg_collection.tp)
        tensors.update({k: v.to(DTYPES[spec.dtype]).contiguous().clone() for k, v in hf_tensors(spec, name, _layer(gpt, name), full).items()})
    pp = runtime.dims.pp
    file = f"model-{runtime.pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    writer = runtime.tp_rank == 0 and runtime.dp_rank == 0
    if writer:
        os.makedirs(args.hf_dir, exist_ok=True)
        save_file(tensors, os.path.join(args.hf_dir, file), metadata={"format": "pt"})
    parts: list[tuple[dict[str, str], int] | None] = [None] * runtime.world_size
    dist.all_gather_object(parts, ({k: file for k in tensors}, sum(t.numel() * t.element_size() for t in tensors.values()))
                           if writer else ({}, 0))
    if runtime.rank == 0:
        weight_map = dict(sorted((k, v) for names, _ in parts for k, v in names.items()))
        size = sum(bytes_ for _, bytes_ in parts)
        with open(os.path.join(args.hf_dir, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": size}, "weight_map": weight_map}, f, indent=1)
        with open(os.path.join(args.hf_dir, "config.json"), "w") as f:
            json.dump(hf_config(spec), f, indent=1)
        copied = copy_tokenizer(tokenizer, args.hf_dir) if tokenizer else []
        print(f"> exported iteration {iteration} of {args.load} to {args.hf_dir}: {spec.family.architecture}, {len(weight_map)} "
              f"{spec.dtype} tensors in {pp} files" + (f", the tokenizer's {', '.join(copied)} from {tokenizer}" if copied else
                                                         ", no tokenizer (the run had no Hugging Face tokenizer)"), flush=True)
    dist.barrier()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.command == "flags":
            spec = read_spec(args.hf_dir)
            ShardReader(args.hf_dir).check(spec)
            print(flag_line(spec, args.hf_dir, args.tensor_model_parallel_size))
            return 0
        status = import_checkpoint(args) if args.command == "import" else export_checkpoint(args)
        shutdown()
        return status
    except (HFCheckpointError, ArgumentError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
