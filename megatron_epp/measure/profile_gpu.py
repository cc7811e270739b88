"""Profile the layer that trains on a GPU (or, for a smoke test, the CPU) and write a planner profile.

The model is described by pretrain_gpt.py's own model flags (``--hidden-size``, ``--num-attention-heads``,
``--ffn-hidden-size``, ``--group-query-attention --num-query-groups``, ``--kv-channels``, ``--swiglu``,
``--normalization RMSNorm``, ``--disable-bias-linear``, ``--rotary-base``, ``--vocab-size``, ...: the same
names, parsed and checked by its parser; its vocabulary padded as training pads it; ``--seq-length`` is the context
cap the profile is keyed by). Measures, in bf16 on CUDA by default (``--dtype fp16|fp32`` as ``--fp16`` or no
``--bf16`` trains), with the attention kernel training would use (``--attention-backend``, else
``EPP_ATTENTION_BACKEND``, as in training):

  * attention of ``s`` queries over ``C`` prefix + ``s`` own keys (K/V heads as the model has them),
    forward and backward, over an ``(s, C)`` grid (``--seq-lengths`` x ``--contexts``): fits ``a1`` (s^2),
    ``a1c`` (s*C), ``ac`` (C) and the per-segment constant;
  * one layer of the training spec (``ChunkRecomputeLayer`` + ``ElasticAttention`` on the local spec, RoPE)
    over ``--layer-lengths`` at ``C = 0``, plain and checkpointed back to back: the linear term ``a2`` and
    the per-chunk constant beside the attention's quadratic part, and the recompute on its own terms;
  * the output head (final norm, output layer, megatron-core's cross entropy) over ``--head-lengths``, those whose
    logits would take over half the GPU's free memory measured at the longest that fits;
  * the memory one layer keeps for its backward per token, plain and checkpointed, the head's, and on CUDA the
    backward's workspace (the caching allocator; on the CPU the tensors autograd saves), fitted per token and
    printed; a grid point that runs out of memory is left out with one line.

The measurement and the fits are the library's (``megatron_epp.measure.profiling.measure_profile``, which
``pretrain_gpt.py --epp-profile auto`` runs at start-up on a small grid; ``megatron_epp.cost.profile_fit``).
Prints every fit's rms error (also stored in the profile's ``fit.errors``) and writes the profile JSON to
``--out``, or, without it, into ``--epp-profile-cache`` under the name ``--epp-profile auto`` looks up.
``"device"`` is the GPU's name, dtype and kernel, ``"source"`` is ``measured``. Timing: CUDA events on a
GPU, the process's CPU time on the CPU (``--device cpu``: for checking the script, its numbers are not a
CPU profile, ``python -m benchmarks.profile_layer`` makes those).

The profile's memory block is measured (``derive = "measured"``): the planner uses it as measured at the
profiled shape and carries it to another shape or TP by the ratio of its basis count (``megatron-gpu`` in bf16/fp16,
``saved-tensors`` in fp32 or on the CPU).

    python -m megatron_epp.measure.profile_gpu --out runs/h100_h1024.json --hidden-size 1024 --num-attention-heads 16
    python -m megatron_epp.measure.profile_gpu --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 \\
        --swiglu --ffn-hidden-size 11008 --normalization RMSNorm --disable-bias-linear --seq-length 16384   # into the cache,
        # for runs of this layer at --seq-length 16384 (the cap is in the key, as are the GPU, dtype, kernel and torch)
    python -m megatron_epp.measure.profile_gpu --device cpu --hidden-size 32 --num-attention-heads 4 --vocab-size 64 \\
        --seq-lengths 16,32,64 --contexts 0,32 --layer-lengths 16,32,64 --head-lengths 16,64 --repeats 2 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path

import torch

from megatron_epp.base.options import add_field_to_parser, int_list
from megatron_epp.cost.profile_lookup import ProfileKey, default_profile_cache, kernel_cache_dir
from megatron_epp.executor import kernels
from megatron_epp.measure.layer_bench import init_single_process
from megatron_epp.config.parser import ArgumentError, build_parser, parse_config
from megatron_epp.config.fields import EPPConfig
from megatron_epp.model.gpt import fused_choice, model_shape
from megatron_epp.measure.profiling import (
    ProfileFailed, ProfileGrid, device_name, kernel_key, measure_profile, report_errors, report_memory,
)

PROG = "epp-profile-gpu"  # its errors' name, however it is run (as epp-plan's)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def model_flags() -> set[str]:
    """pretrain_gpt.py's model flags (its parser's "model" group), the ones this script takes from it."""
    group = next(g for g in build_parser()._action_groups if g.title == "model")
    return {flag for action in group._group_actions for flag in action.option_strings}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--out", default=None, help="the profile JSON to write (default: into --epp-profile-cache, for --epp-profile auto)")
    add_field_to_parser(p, next(f for f in fields(EPPConfig) if f.name == "profile_cache"))  # pretrain_gpt.py's own option
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--name", default=None, help="the profile's model name (default: gpu-h<hidden>)")
    p.add_argument("--seq-lengths", type=int_list, default=(512, 1024, 2048, 4096, 8192, 16384), help="attention grid: s")
    p.add_argument("--contexts", type=int_list, default=(0, 4096, 16384, 49152), help="attention grid: C")
    p.add_argument("--layer-lengths", type=int_list, default=(1024, 2048, 4096, 8192, 16384, 32768))
    p.add_argument("--head-lengths", type=int_list, default=(1024, 4096, 8192, 16384))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args, rest = p.parse_known_args(argv)
    flags = model_flags()
    foreign = [a for a in rest if a.startswith("--") and a.split("=")[0] not in flags]
    if foreign:
        p.error(f"{foreign[0]}: not a flag of this script nor a model flag of pretrain_gpt.py")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    try:  # the model as pretrain_gpt.py builds it from these flags (defaults, checks, padded vocabulary)
        dtype_flag = {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(args.dtype, [])
        model = parse_config([*rest, "--mock-data", "--train-iters", "1", *dtype_flag], world_size=1)
    except ArgumentError as error:
        p.error(str(error).removeprefix("pretrain_gpt.py: error: "))
    args.shape = model_shape(model, args.name or f"gpu-h{model.model.hidden_size}")
    args.rotary_base, args.seq_length, args.attention_backend = model.model.rotary_base, model.model.seq_length, model.model.attention_backend
    args.model = model  # the fused kernels are chosen from its flags (as training chooses them)
    args.grid = ProfileGrid(args.seq_lengths, args.contexts, args.layer_lengths, args.head_lengths, args.warmup, args.repeats)
    try:
        args.grid.check()
    except ValueError as error:
        p.error(str(error))
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False (use --device cpu to smoke-test the script)")
    return args


def main(argv: list[str] | None = None) -> int:
    """The command line (``python -m megatron_epp.measure.profile_gpu``, ``epp-profile-gpu``)."""
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda":  # as training sets up a GPU rank (the first contact's layer grid ran this way)
        torch.cuda.set_device(0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    if device.type == "cuda":  # before flash-attn-4 is imported (the kernel decision below)
        print(f"flash-attn-4: {kernels.fa4.configure_compile_cache(kernel_cache_dir(args.epp_profile_cache))}", flush=True)
    init_single_process()  # the process group (gloo on CPU, one thread) and megatron-core's model-parallel state
    torch.manual_seed(0)
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)  # the RNG tracker the recompute checkpoint reads
    shape = args.shape
    # as training chooses: --attention-backend, else EPP_ATTENTION_BACKEND
    heads = (shape.num_heads, shape.num_kv_heads or shape.num_heads, shape.head_dim)  # flash-attn-4's probe: one GPU's
    kernel = kernels.select_backend(kernels.requested_backend(args.attention_backend), device, dtype,
                                    gqa=heads[1] != heads[0], heads=heads)
    fused_kernels = fused_choice(args.model, device, elastic=True)
    name = device_name(device, dtype, kernel_key(kernel, fused_kernels, args.shape.loss_chunk_tokens, args.shape.mlp_chunk_tokens))
    kv = f", {shape.num_kv_heads} K/V heads" if shape.num_kv_heads else ""
    print(f"profiling {shape.name} (hidden {shape.hidden}, {shape.num_heads} heads{kv} x {shape.head_dim}, ffn {shape.ffn_hidden}"
          f"{' SwiGLU' if shape.swiglu else ''}, {shape.normalization}{'' if shape.bias else ', no biases'}, vocab {shape.vocab}) on {name}", flush=True)
    try:
        profile = measure_profile(shape, device, dtype, kernel, args.grid, name=name, rotary_base=args.rotary_base,
                                  log=lambda line: print(line, flush=True), note="measured by megatron_epp.measure.profile_gpu",
                                  seq_length=args.seq_length, fused_kernels=fused_kernels)
    except ProfileFailed as error:
        print(f"{PROG}: error: {error} (a smaller grid: --layer-lengths, --head-lengths, --seq-lengths)", file=sys.stderr)
        return 1
    if args.out:
        out = Path(args.out)
    else:
        key = ProfileKey.from_profile(profile)
        if key is None:
            print(f"{PROG}: error: a CPU run has no cache key (--out FILE)", file=sys.stderr)
            return 2
        out = Path(args.epp_profile_cache or default_profile_cache()).expanduser() / key.file_name()
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    print(f"wrote {out} ({profile.fit['seconds']:.1f} s): device {name!r}, source measured")
    report_errors(profile)
    report_memory(profile)
    errors, m = profile.fit["errors"], profile.memory
    memory = {k: getattr(m, k) for k in ("act_token", "ckpt_token", "logits_token", "bwd_workspace")}
    print(json.dumps({"profile": str(out), "device": name, "worst_rms_rel_err": max(e["rms_rel_err"] for e in errors.values()),
                      "memory": memory}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
