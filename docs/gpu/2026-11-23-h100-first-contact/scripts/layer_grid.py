"""First-contact helper (not part of the repo): forward/backward time of ONE transformer layer as the
elastic path trains it, on CUDA with CUDA events.

The layer is built through the project's own spec: ``elastic_layer_spec(default_layer_spec())``
(ChunkRecomputeLayer + ElasticAttention on Megatron-Core's local GPT layer spec, GELU MLP with
biases, i.e. what ``pretrain_gpt.py --elastic-pp`` builds when Transformer Engine is absent), with the
TransformerConfig from ``megatron_epp.training.model.transformer_config`` (bf16 params). RoPE
frequencies are computed once per shape outside the timed region (the model does that once per
chunk, not per layer), through ``ChunkRotaryEmbedding`` at the chunk's position ids.

(a) batched: one whole sequence of ``s`` tokens (causal, no prefix).
(b) split: the last slice of a sequence, ``s`` tokens attending to ``C`` prefix tokens held as
    K/V leaves in CHUNK_STATE (as an earlier slice keeps them); ``C = 0`` is the first slice of a
    longer sequence (it keeps its K/V for later slices).

Per shape: warm-up, then the median over repeats of CUDA-event ms of forward and of backward
(``out.backward(g)``), peak allocated memory, and achieved TFLOP/s from the model FLOPs:
forward = 2 * s * (GEMM params) + 4 * h * s * (C + (s + 1) / 2) (QK^T and PV over the causal pairs),
backward = 2 x forward.

    python3 layer_grid.py --json grid.json [--cpu-dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(os.environ.get("EPP_REPO", Path(__file__).resolve().parent / "repo"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

K = 1024


def build_layer(hidden: int, heads: int, ffn: int, device):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module

    from megatron_epp.model.rotary import ChunkRotaryEmbedding
    from megatron_epp.model.spec import elastic_layer_spec
    from megatron_epp.training.arguments import parse_args
    from megatron_epp.training.model import default_layer_spec, transformer_config

    flags = ["--elastic-pp", "--mock-data", "--num-layers", "1", "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
             "--ffn-hidden-size", str(ffn), "--seq-length", str(256 * K), "--vocab-size", "257", "--epp-memory-budget", "70"]
    if device.type == "cuda":
        flags.append("--bf16")
    args = parse_args(flags, world_size=1)

    class RT:  # the part of Runtime that transformer_config reads
        pass

    rt = RT()
    rt.device = device
    config = transformer_config(args, rt)
    spec = elastic_layer_spec(default_layer_spec())
    layer = build_module(spec, config=config, layer_number=1).to(device)
    if device.type == "cuda":
        layer.bfloat16()  # as build_model does with --bf16 after the first-contact fix (LayerNorm params)
    rotary = ChunkRotaryEmbedding(RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                                                  use_cpu_initialization=device.type == "cpu")).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gemm_params = sum(p.numel() for n, p in layer.named_parameters() if p.dim() == 2)
    return layer, rotary, config, dtype, gemm_params, type(spec.submodules.self_attention.submodules.linear_qkv).__name__


def time_shape(layer, rotary, config, dtype, device, s: int, C: int, kind: str, warmup: int, repeats: int):
    from megatron_epp.model.chunk_state import CHUNK_STATE, ChunkLayout
    from megatron_epp.plan import Chunk, Segment, chunk_kind

    h, heads = config.hidden_size, config.num_attention_heads
    d = h // heads
    if kind == "batched":
        lengths, segs = [s], [Segment(0, 0, s)]
    elif C == 0:  # first slice of a longer sequence: keeps its K/V
        lengths, segs = [s + 1], [Segment(0, 0, s)]
    else:  # last slice after C prefix tokens
        lengths, segs = [C + s], [Segment(0, C, C + s)]
    chunk = Chunk(0, chunk_kind(segs, lengths), segs)
    layout = ChunkLayout.build(chunk, lengths, device)
    CHUNK_STATE.clear()
    CHUNK_STATE.current = layout
    gen = torch.Generator(device=device).manual_seed(0)
    prefix = None
    if C > 0:
        prefix = tuple(torch.randn(C, 1, heads, d, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(2))
    freqs = rotary(s)
    x = torch.randn(s, 1, h, device=device, dtype=dtype, generator=gen).requires_grad_()
    g = torch.randn(s, 1, h, device=device, dtype=dtype, generator=gen)

    def one():
        if prefix is not None:
            CHUNK_STATE.keep(0, layer.layer_number, 0, prefix)
        out, _ = layer(hidden_states=x, attention_mask=None, rotary_pos_emb=freqs)
        return out

    cuda = device.type == "cuda"
    fwd, bwd = [], []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for i in range(warmup + repeats):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        if cuda:
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            out = one()
            e1.record()
            out.backward(g)
            e2.record()
            torch.cuda.synchronize()
            f, b = e0.elapsed_time(e1), e1.elapsed_time(e2)
        else:
            t0 = time.perf_counter()
            out = one()
            t1 = time.perf_counter()
            out.backward(g)
            t2 = time.perf_counter()
            f, b = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        del out
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
    CHUNK_STATE.clear()
    return statistics.median(fwd), statistics.median(bwd), peak, fwd, bwd, chunk.kind


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--cpu-dry-run", action="store_true")
    p.add_argument("--shapes", default="1024:16:4096,4096:32:11008", help="hidden:heads:ffn,...")
    p.add_argument("--batched", default="1,2,4,8,16,32", help="s in K tokens")
    p.add_argument("--split-s", default="4,16")
    p.add_argument("--split-c", default="0,8,32,96")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=170.0, help="stop starting new shapes after this many seconds")
    a = p.parse_args()
    t_start = time.time()
    from megatron.core import parallel_state as ps

    from megatron_epp.training.initialize import select_device, set_seed

    device, backend = select_device()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group(backend, rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    set_seed(1234, 0)
    unit = 1 if a.cpu_dry_run else K
    if a.cpu_dry_run:
        a.shapes, a.repeats, a.warmup = "64:4:256,128:4:344", 1, 1
    from megatron_epp.model import attention_kernels

    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "attention_request": attention_kernels.requested_backend(), "warmup": a.warmup, "repeats": a.repeats,
           "flop_model": "fwd = 2*s*gemm_params + 4*h*s*(C+(s+1)/2); bwd = 2*fwd", "rows": []}
    print(f"{'hidden':>6} {'kind':>7} {'s':>6} {'C':>6} {'fwd ms':>9} {'bwd ms':>9} {'fwd TF/s':>8} {'bwd TF/s':>8} {'peak GB':>7}")
    for shape in a.shapes.split(","):
        h, heads, ffn = (int(x) for x in shape.split(":"))
        layer, rotary, config, dtype, gemm_params, _ = build_layer(h, heads, ffn, device)
        cases = [("batched", int(s) * unit, 0) for s in a.batched.split(",")]
        cases += [("split", int(s) * unit, int(c) * unit) for s in a.split_s.split(",") for c in a.split_c.split(",")]
        for kind, s, C in cases:
            if time.time() - t_start > a.budget_s:
                print(f"budget of {a.budget_s} s spent: skipping hidden {h} {kind} s={s} C={C}")
                out["rows"].append({"hidden": h, "kind": kind, "s": s, "C": C, "skipped": "time budget"})
                continue
            try:
                f, b, peak, fs, bs, ck = time_shape(layer, rotary, config, dtype, device, s, C, kind, a.warmup, a.repeats)
            except Exception as error:
                msg = f"{type(error).__name__}: {str(error)[:300]}"
                print(f"{h:6d} {kind:>7} {s:6d} {C:6d} FAILED {msg}")
                out["rows"].append({"hidden": h, "heads": heads, "ffn": ffn, "kind": kind, "s": s, "C": C, "error": msg})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            flops_f = 2.0 * s * gemm_params + 4.0 * h * s * (C + (s + 1) / 2)
            tf_f, tf_b = flops_f / (f * 1e-3) / 1e12, 2 * flops_f / (b * 1e-3) / 1e12
            print(f"{h:6d} {kind:>7} {s:6d} {C:6d} {f:9.3f} {b:9.3f} {tf_f:8.1f} {tf_b:8.1f} {peak:7.2f}", flush=True)
            out["rows"].append({"hidden": h, "heads": heads, "ffn": ffn, "kind": kind, "chunk_kind": ck, "s": s, "C": C,
                                "fwd_ms": f, "bwd_ms": b, "fwd_ms_all": fs, "bwd_ms_all": bs, "peak_gb": peak,
                                "fwd_tflops": tf_f, "bwd_tflops": tf_b, "gemm_params": gemm_params})
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["wall_s"] = time.time() - t_start
    Path(a.json).write_text(json.dumps(out, indent=1))
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
