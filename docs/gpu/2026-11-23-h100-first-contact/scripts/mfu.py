"""Tokens/s and MFU of the --elastic-pp runs: per-iteration document lengths re-drawn from the same
sampler (same flags, seed) on CPU, checked against the log's tokens=, then
model FLOPs = 6 * (layer GEMM params + head params) * T + 6 * layers * h * sum(L^2)
(causal attention: QK^T and PV over L^2/2 pairs, 2 FLOPs per multiply-add, fwd + 2x bwd; recompute not counted),
MFU = FLOPs / iteration time / 989e12 (H100 SXM bf16 dense)."""
import re, sys, json, statistics
sys.path.insert(0, '/work/main/.gpu/repo')
from megatron_epp.training.arguments import parse_args
from megatron_epp.training.elastic import elastic_sampler
L, H, V = 8, 1024, 257
gemm = L * 12 * H * H + V * H
PEAK = 989e12
flags = ['--elastic-pp', '--mock-data', '--num-layers', '8', '--hidden-size', '1024', '--num-attention-heads', '16',
         '--seq-length', '16384', '--global-batch-size', '32', '--vocab-size', '257', '--epp-memory-budget', '70']
args = parse_args(flags, world_size=1)
it = elastic_sampler(args, 'train', 1).iterate(0)
batches = [next(it) for _ in range(16)]
rows = {}
for name, path in [(a.split('=')[0], a.split('=')[1]) for a in sys.argv[1:]]:
    out = []
    for line in open(path):
        m = re.search(r'iteration\s+(\d+)/.*per iteration \(ms\): ([\d.]+) \| tokens/s: (\d+).*tokens=(\d+) .*predicted ms: ([\d.]+) \| measured ms: ([\d.]+) \| act MB pred/meas per stage: ([\d.]+)/([\d.]+)', line)
        if not m:
            continue
        i, ms, tps, tok = int(m[1]), float(m[2]), int(m[3]), int(m[4])
        lengths = [int(x) for x in batches[i - 1].seq_lengths]
        assert sum(lengths) == tok, (name, i, sum(lengths), tok)
        sq = sum(x * x for x in lengths)
        flops = 6 * gemm * tok + 6 * L * H * sq
        out.append(dict(it=i, ms=ms, tokens=tok, tokens_s=tok / ms * 1e3, max_len=max(lengths), sumL2=sq, attn_frac=6 * L * H * sq / flops,
                        tflops=flops / ms * 1e-9, mfu=flops / (ms * 1e-3) / PEAK, pred_ms=float(m[5]), meas_ms=float(m[6]),
                        act_pred_mb=float(m[7]), act_meas_mb=float(m[8])))
    s = [r for r in out if r['it'] >= 2]
    tot_tok, tot_ms = sum(r['tokens'] for r in s), sum(r['ms'] for r in s)
    tot_fl = sum(r['tflops'] * r['ms'] * 1e-3 * 1e12 for r in s)
    summ = dict(iters=len(out), iters_used=f"2..{max(r['it'] for r in out)}", median_ms=statistics.median(r['ms'] for r in s),
                tokens_s=tot_tok / tot_ms * 1e3, tflops=tot_fl / (tot_ms * 1e-3) / 1e12, mfu=tot_fl / (tot_ms * 1e-3) / PEAK,
                attn_flop_frac=statistics.mean(r['attn_frac'] for r in s),
                pred_over_meas_ms=statistics.median(r['pred_ms'] / r['meas_ms'] for r in s),
                act_meas_over_pred=statistics.median(r['act_meas_mb'] / r['act_pred_mb'] for r in s),
                act_meas_over_pred_range=[min(r['act_meas_mb'] / r['act_pred_mb'] for r in s), max(r['act_meas_mb'] / r['act_pred_mb'] for r in s)],
                first_loss_last_loss=None)
    rows[name] = dict(summary=summ, iterations=out)
    print(f"{name:<32} " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summ.items() if v is not None))
json.dump(dict(gemm_params=gemm, peak=PEAK, runs=rows), open('/work/gpu_results/mfu.json', 'w'), indent=1)
