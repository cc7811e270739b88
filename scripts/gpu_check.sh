#!/usr/bin/env bash
# One command for a GPU machine (one GPU is enough): install what can be installed offline, then
# check and measure the CUDA path, each step time-boxed, going on after a failed step, with a
# summary at the end and, last, one JSON line of every figure measured (python -m benchmarks.gpu_check_report).
#
#   bash scripts/gpu_check.sh --quick [--out DIR] [--wheels DIR]    # one command of at most 9.5 minutes (570 s of limits)
#   bash scripts/gpu_check.sh [--out DIR] [--wheels DIR] [--build-timeout S] [--steps LIST] [--dry-run]   # the full check
#
# --quick: facts, install (megatron-core and requirements-gpu-kernels.txt from their wheels: no Transformer Engine or
# flash-attn build), attention (--budget-s 30; flash-attn-4 where it imports, compiled before the timings), the pp=1
# equivalence, one training run on the default path a user takes (NO --epp-profile: the start-up profile measures time
# and allocator memory on this GPU with the kernels chosen; NO --epp-memory-budget: the GPU's free memory less the
# margin; a model large enough that this budget binds on an H100 and an H200: recompute and smaller chunks than the
# cap; --log-throughput; the allocator's reserved and allocated peak of every step against the budget, and any
# out-of-memory recovery), then the same run on the same batches with the kernels before flash-attn-4 and the fused
# pointwise ops (baseline: torch's varlen_attn, unfused), paired by iteration in the report (kernels_ab: ms, TFLOP/s,
# MFU). The limits sum to 570 s. The bench's three cells (--steps bench, about 7 minutes on an H200) and the full
# check (about 18 minutes on one H100, 35 at most) are for further commands.
#
# Steps (--steps takes a comma-separated subset, in this order):
#   facts        GPU, driver, torch, what imports
#   install      scripts/setup_gpu.sh --find-links WHEELS (offline; optional kernels from wheels only
#                unless --build-timeout S > 0; skipped without --wheels when megatron-core imports)
#   attention    python -m benchmarks.check_cuda_attention: torch's varlen_attn, sdpa-causal (and flash-attn varlen
#                where it imports) in bf16 against an fp32 reference (query blocks: one block's scores in
#                memory), on batched, split and hybrid chunks, timed within 45 s; the bytes torch-varlen saves
#                per layer with GQA and whether the K/V heads were expanded (the summary shows the line)
#   equivalence  tests/integration/test_elastic_equivalence.py, its one-process cases (-k pp1): elastic vs stock
#                Megatron-Core in fp32 (SDPA, < 1e-5) and bf16 elastic vs fp32 (every attention backend
#                that runs; < 16 u); runs of more processes than GPUs are skipped, with the reason
#   fused        python -m benchmarks.fused_kernels: each fused pointwise candidate (torch.compile, liger-kernel,
#                quack-kernels) per op against torch's op at the quick model's shapes, time and error; its JSON line
#   profile      python -m megatron_epp.measure.profile_gpu: the layer's cost profile on this GPU (bf16, CUDA events)
#   train        pretrain_gpt.py --elastic-pp --bf16 at pp=1 under a tight --epp-memory-budget (split
#                and hybrid chunks, recompute), on the profile just measured (else the analytic llama-7b)
#   baseline     (--quick) the train step's run again on the same batches with the kernels before flash-attn-4 and the
#                fused pointwise ops: EPP_ATTENTION_BACKEND=varlen EPP_FUSED_KERNELS=torch
#   offload      (opt-in) benchmarks/check_kv_host_cuda.py (K/V buffers on the host through the CUDA block kernel
#                against the device-buffer run), then the train step's run with --epp-offload checkpoints on the same
#                batches (the host link measured at start-up); the report pairs it with the train step's (offload_ab)
#   longest      (opt-in; its own session: up to 8 minutes) benchmarks/longest_trainable.py: the longest single document
#                the train check's model (with the chunked head and the tiled MLP) trains under a 4 GB budget, without
#                offload and with --epp-offload checkpoints, by training it (doubling, then bisection to 4,096 tokens;
#                each probe a run with the start-up profile), then both at the longest length both train
#   bench        python -m benchmarks.bench_gpu: Megatron packing, Seq1F1B, EPP and EPP without memory limit on a
#                LLaMA-like 8-layer model under a binding budget (~7.5 min); its JSON line in the summary
#
# --out DIR           everything goes there: <step>.log, install/, profile.json, metrics.jsonl, summary.txt
#                     (default: runs/gpu_check-<time>)
# --wheels DIR        wheels for setup_gpu.sh --wheels: DIR and its parts DIR/1, DIR/2 (scripts/gpu_wheels.sh)
#                     (default: $EPP_WHEELS, else .whl if present)
# --build-timeout S   passed to setup_gpu.sh (default 0: wheels only, nothing compiled; flash-attn from
#                     source alone takes 10-25 min)
# --quick             the steps above in at most 480 s
# --dry-run           print the steps' commands and limits (and their sum), run nothing
# --cpu-rehearsal     run the same steps on the CPU at toy sizes (attention --cpu-dry-run, a tiny profile
#                     grid, a tiny model): checks this script's plumbing before device time is spent
# Without CUDA it refuses with one line (exit 2). Exit 0 when every step passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

OUT_DIR="" WHEELS=${EPP_WHEELS:-} BUILD_TIMEOUT=0 STEPS="" DRY_RUN=0 REHEARSAL=0 QUICK=0
ALL_STEPS=(facts install attention equivalence fused profile train baseline offload longest bench)
usage_error() { echo "gpu_check.sh: error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || usage_error "--out needs a directory"; OUT_DIR=$2; shift 2 ;;
    --wheels) [ $# -ge 2 ] || usage_error "--wheels needs a directory"; WHEELS=$2; shift 2 ;;
    --build-timeout) [ $# -ge 2 ] || usage_error "--build-timeout needs seconds"; BUILD_TIMEOUT=$2; shift 2 ;;
    --steps) [ $# -ge 2 ] || usage_error "--steps needs a list"; STEPS=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --cpu-rehearsal) REHEARSAL=1; shift ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) usage_error "unknown option $1 (see --help)" ;;
  esac
done
[[ "$BUILD_TIMEOUT" =~ ^[0-9]+$ ]] || usage_error "--build-timeout $BUILD_TIMEOUT: expected whole seconds"
[ "$QUICK" = 0 ] || [ "$BUILD_TIMEOUT" = 0 ] || usage_error "--quick builds nothing: --build-timeout is for the full check"
if [ -z "$STEPS" ]; then
  if [ "$QUICK" = 1 ]; then STEPS="facts,install,attention,equivalence,fused,train,baseline"; else STEPS="facts,install,attention,equivalence,fused,profile,train,bench"; fi
fi
IFS=',' read -ra WANTED <<< "$STEPS"
for step in "${WANTED[@]}"; do
  [[ " ${ALL_STEPS[*]} " == *" $step "* ]] || usage_error "--steps: unknown step '$step' (known: ${ALL_STEPS[*]})"
done
wanted() { [[ ",$STEPS," == *",$1,"* ]]; }
if [ -z "$WHEELS" ] && [ -d .whl ]; then WHEELS=.whl; fi
[ -z "$WHEELS" ] || [ -d "$WHEELS" ] || usage_error "--wheels $WHEELS: no such directory"
OUT_DIR=${OUT_DIR:-runs/gpu_check-$(date +%Y%m%d-%H%M%S)}
PYTHON=${PYTHON:-python3}

# The training check: one GPU, pp=1, bf16, long mock documents, a budget tight enough to split and recompute.
TRAIN_FLAGS=(--elastic-pp --pipeline-model-parallel-size 1 --bf16 --mock-data --num-layers 8 --hidden-size 1024
  --num-attention-heads 16 --seq-length 16384 --global-batch-size 32 --lr 3e-4 --lr-warmup-iters 2 --train-iters 12
  --log-interval 1 --epp-memory-budget 4 --epp-plan seq1f1b --epp-max-slices 4)
# The train check is of the executor on CUDA (split slices over prefix K/V, hybrid tails, flash-varlen):
# Seq1F1B's fixed k = 4 slices every long document whatever the profile says, where the elastic builder
# may rightly prefer packing (and then exercise neither).
# The profile: the training check's shape, the default grid of megatron_epp.measure.profile_gpu.
PROFILE_FLAGS=(--hidden-size 1024 --num-attention-heads 16 --num-layers 8 --seq-length 16384)  # the train check's cap: its key
ATTENTION_FLAGS=()
# the baseline run (--quick): the kernels before flash-attn-4 (torch's varlen_attn) and before the fused pointwise ops
BASELINE_ENV=(EPP_ATTENTION_BACKEND=varlen EPP_FUSED_KERNELS=torch)
BASELINE_FLAGS=()
FUSED_FLAGS=(--repeats 5)
# the longest document (issue 41): the train check's model in bf16 with the chunked head and the tiled MLP, a 4 GB budget
# (model states about 2.4 GB: the longest document stays short enough that its quadratic attention trains in seconds)
LONGEST_FLAGS=(--model-flags "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --bf16 --epp-loss-chunk-tokens 4096 --epp-mlp-chunk-tokens 8192"
  --epp-memory-budget 4 --start 16384 --resolution 4096 --max-probes 5 --budget-s 420 --iters 3)
KV_HOST_FLAGS=()  # benchmarks/check_kv_host_cuda.py's defaults: a 16K document in four slices, 32:8 heads of 128, bf16
# --quick's train and baseline runs: torch.profiler records one iteration of each (the same one), summarised by kernel
# class (benchmarks/trace_kernels.py): where the step's device time goes; that iteration is left out of kernels_ab's medians
TRACE_ITERATION=9  # the quick model's shapes (the benchmark's defaults): each candidate per op against torch's op
# the equivalence tests of one process (pp=1), the ones a single GPU runs
EQUIVALENCE_SELECTION=(-k pp1)
BENCH_FLAGS=()
# --quick's run on the default path: a LLaMA-style model (GQA 16:4, SwiGLU, RMSNorm, no biases) of 40 layers of
# hidden 2048 at a 32K cap: 2.2B parameters (30 GB of model states with Adam), and a 32K-token chunk needs about
# 100 GB of activations without recompute on the memory model, so the default budget (the free memory less 5 %: about
# 132 GB on an H200, 73 GB on an H100) binds on both (planned offline on the analytic profile, 2026-11-27); 8 mock
# documents a step (median 4K tokens, the longest at the cap); 10 steps, the memory factor refitted after the 5th.
QUICK_MODEL=(--num-layers 40 --hidden-size 2048 --num-attention-heads 16 --group-query-attention --num-query-groups 4
  --swiglu --ffn-hidden-size 5632 --normalization RMSNorm --disable-bias-linear --seq-length 32768)
QUICK_TRAIN_FLAGS=(--elastic-pp --pipeline-model-parallel-size 1 --bf16 --mock-data "${QUICK_MODEL[@]}" --global-batch-size 8
  --lr 3e-4 --lr-warmup-iters 2 --train-iters 10 --log-interval 1 --log-throughput)
if [ "$QUICK" = 1 ]; then
  TRAIN_FLAGS=("${QUICK_TRAIN_FLAGS[@]}")
  ATTENTION_FLAGS=(--budget-s 30)
  BENCH_FLAGS=(--cells mock:32768 --iters 1 --runs megatron,epp --model-flags "${QUICK_MODEL[*]}")
fi
if [ "$REHEARSAL" = 1 ]; then  # the same steps at toy sizes on the CPU
  TRAIN_FLAGS=(--elastic-pp --pipeline-model-parallel-size 1 --bf16 --mock-data --num-layers 2 --hidden-size 32
    --num-attention-heads 4 --seq-length 512 --global-batch-size 8 --lr 5e-3 --lr-warmup-iters 2 --train-iters 8
    --log-interval 1 --epp-memory-budget 0.004 --epp-plan seq1f1b --epp-max-slices 4)
  [ "$QUICK" = 1 ] && TRAIN_FLAGS=(--elastic-pp --pipeline-model-parallel-size 1 --bf16 --mock-data --num-layers 2 --hidden-size 32
    --num-attention-heads 4 --seq-length 512 --global-batch-size 8 --lr 5e-3 --lr-warmup-iters 2 --train-iters 6
    --log-interval 1 --log-throughput)  # the default path: the CPU's default profile and budget
  PROFILE_FLAGS=(--device cpu --hidden-size 32 --num-attention-heads 4 --num-layers 2 --seq-lengths 16,32,64 --contexts 0,32
    --layer-lengths 16,32,64,128 --head-lengths 16,64 --repeats 2)
  ATTENTION_FLAGS=(--cpu-dry-run)
  KV_HOST_FLAGS=(--cpu-dry-run)
  LONGEST_FLAGS=(--model-flags "--num-layers 2 --hidden-size 32 --num-attention-heads 4" --epp-memory-budget 0.006 --start 1024
    --resolution 1024 --max-probes 2 --budget-s 60 --iters 2)
  FUSED_FLAGS=(--device cpu --tokens 64 --hidden 64 --heads 4 --kv-heads 2 --ffn 96 --vocab 128 --repeats 2 --candidates torch)
  BASELINE_ENV=(EPP_ATTENTION_BACKEND=sdpa EPP_FUSED_KERNELS=torch)  # torch's varlen_attn runs on CUDA only
  TRACE_ITERATION=5  # of 6
  BENCH_FLAGS=(--dry-run --cells mock:16384)  # plans the cell and prints its commands; trains nothing
  [ "$QUICK" = 1 ] && BENCH_FLAGS=(--dry-run --cells mock:16384 --runs megatron,epp --model-flags "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 8192")
fi

# per step: its time limit (s; 34.5 min in all without builds) and its command
declare -A LIMIT=([facts]=60 [install]=$((150 + BUILD_TIMEOUT * 2)) [attention]=180 [equivalence]=420 [fused]=180 [profile]=300 [train]=360 [baseline]=360 [offload]=420 [longest]=480 [bench]=600)
# --quick: 570 s in all (the device machines lend 10 minutes a command and 15 a session, its start included); the
# first contact with flash-attn-4 compiles its kernels (tens of seconds each, cached on disk for the later steps)
[ "$QUICK" = 1 ] && declare -A LIMIT=([facts]=15 [install]=75 [attention]=80 [equivalence]=85 [fused]=60 [profile]=0 [train]=140 [baseline]=115 [offload]=200 [longest]=480 [bench]=600)
QUICK_SETUP=""
[ "$QUICK" = 1 ] && QUICK_SETUP="--no-te --no-flash"  # no wheel of either exists for the GPU machines; the full check tries
command_of() {
  case "$1" in
    facts) echo "nvidia-smi; $PYTHON - (versions; which optional packages import)" ;;
    install) echo "bash scripts/setup_gpu.sh --wheels ${WHEELS:-<none>} --build-timeout $BUILD_TIMEOUT${QUICK_SETUP:+ $QUICK_SETUP} --log-dir $OUT_DIR/install" ;;
    attention) echo "$PYTHON -m benchmarks.check_cuda_attention ${ATTENTION_FLAGS[*]}" ;;
    equivalence) echo "$PYTHON -m pytest -q -p no:cacheprovider -rs tests/integration/test_elastic_equivalence.py ${EQUIVALENCE_SELECTION[*]}" ;;
    fused) echo "$PYTHON -m benchmarks.fused_kernels ${FUSED_FLAGS[*]}" ;;
    profile) echo "$PYTHON -m megatron_epp.measure.profile_gpu ${PROFILE_FLAGS[*]} --out $OUT_DIR/profile.json" ;;
    train) if [ "$QUICK" = 1 ]; then
             echo "$PYTHON -m torch.distributed.run --nproc-per-node 1 pretrain_gpt.py ${TRAIN_FLAGS[*]} --epp-metrics $OUT_DIR/metrics.jsonl (no --epp-profile: the start-up profile; no --epp-memory-budget: the default budget)"
           else
             echo "$PYTHON -m torch.distributed.run --nproc-per-node 1 pretrain_gpt.py ${TRAIN_FLAGS[*]} --epp-profile <profile.json, else llama-7b> --epp-metrics $OUT_DIR/metrics.jsonl"
           fi ;;
    offload) echo "$PYTHON -m benchmarks.check_kv_host_cuda ${KV_HOST_FLAGS[*]}; the train step's run with --epp-offload checkpoints (metrics_offload.jsonl)" ;;
    baseline) echo "${BASELINE_ENV[*]} $PYTHON -m torch.distributed.run --nproc-per-node 1 pretrain_gpt.py ${TRAIN_FLAGS[*]} ${BASELINE_FLAGS[*]} --epp-metrics $OUT_DIR/metrics_baseline.jsonl (the train step's run, the kernels before)" ;;
    longest) echo "$PYTHON -m benchmarks.longest_trainable ${LONGEST_FLAGS[*]}" ;;
    bench) echo "$PYTHON -m benchmarks.bench_gpu ${BENCH_FLAGS[*]}" ;;
  esac
}

if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_check.sh --dry-run: would write $OUT_DIR and run:"
  TOTAL=0
  for step in "${ALL_STEPS[@]}"; do
    wanted "$step" && printf '  %-12s (limit %4d s)  %s\n' "$step" "${LIMIT[$step]}" "$(command_of "$step")" && TOTAL=$((TOTAL + LIMIT[$step]))
  done
  echo "limits: $TOTAL s in all"
  exit 0
fi

CUDA_FACT=$("$PYTHON" -c 'import torch; print("ok" if torch.cuda.is_available() else f"torch {torch.__version__}: torch.cuda.is_available() is False")' 2>&1 | tail -n 1)
[ "$CUDA_FACT" = ok ] || [ "$REHEARSAL" = 1 ] || usage_error "no CUDA device ($CUDA_FACT); this script is for a GPU machine (--dry-run shows its steps)"

mkdir -p "$OUT_DIR" || usage_error "--out $OUT_DIR: cannot create it"
rm -f "$OUT_DIR/steps.tsv"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
RESULTS=() FAILED=0

run_step() {  # run_step NAME COMMAND...: time-boxed, output in OUT_DIR/NAME.log, a result line
  local name=$1 start=$SECONDS rc=0 status took result; shift
  echo "=== $name (limit ${LIMIT[$name]} s): $(command_of "$name")"
  if declare -F "$1" > /dev/null; then  # a function of this script: timeout runs programs, so hand it to a bash
    set -- bash -c "$(declare -p PYTHON WHEELS BUILD_TIMEOUT OUT_DIR TRAIN_FLAGS BASELINE_ENV BASELINE_FLAGS KV_HOST_FLAGS TRACE_ITERATION REHEARSAL QUICK QUICK_SETUP); $(declare -f "$1" train); $1"
  fi
  timeout -k 20 "${LIMIT[$name]}" "$@" > "$OUT_DIR/$name.log" 2>&1 || rc=$?
  took=$((SECONDS - start))
  if [ "$rc" = 0 ]; then status=ok
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=TIMEOUT; FAILED=1
  else status="FAILED rc=$rc"; FAILED=1
  fi
  result=$(result_of "$name" "$rc")
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$took" "${LIMIT[$name]}" >> "$OUT_DIR/steps.tsv"
  RESULTS+=("$(printf '%-12s %-14s %5d s  %s' "$name" "$status" "$took" "$result")")
  echo "    -> $status in $took s: $result"
}

result_of() {  # one line from a step's log
  local log="$OUT_DIR/$1.log"
  case "$1" in
    facts) grep -E '^(gpu|torch) ' "$log" | tr '\n' ';' ;;
    install) grep -E '^> elastic attention|WARNING|error' "$log" | cut -c1-160 | tr '\n' ';' ;;
    attention) grep -E '^(PASS|FAIL|saved bytes per layer)' "$log" | head -n 3 | tr '\n' ';' ;;
    equivalence) grep -E '(passed|failed|error|skipped)' "$log" | tail -n 2 | tr '\n' ';' ;;
    fused) grep -E '^\{' "$log" | tail -n 1 | cut -c1-300 ;;
    profile) grep -E 'rms rel err' "$log" | awk '{printf "%s %s%%; ", $1, $5}' ;;
    train|baseline) grep -E '^train:' "$log" | tail -n 1 ;;
    offload) { grep -E '^check_kv_host_cuda:' "$log"; grep -E '^> host link:' "$log" | cut -c1-120; grep -E '^train:' "$log"; } | tr '\n' ';' ;;
    longest) grep -E '^(none|checkpoints|auto): longest|^at [0-9,]+ tokens' "$log" | tr '\n' ';' ;;
    bench) if [ "$REHEARSAL" = 1 ]; then grep -E '^estimated time' "$log" | tail -n 1; else grep -E '^\{' "$log" | tail -n 1; fi ;;
  esac
  [ "$2" = 0 ] || echo " (last line: $(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200))"
}

facts() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  "$PYTHON" - <<'PY'
import importlib, sys
import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu {p.name} cc {p.major}.{p.minor} {p.total_memory / 2**30:.1f} GiB, {torch.cuda.device_count()} device(s)")
else:
    print("gpu none (CPU rehearsal)")
print(f"torch {torch.__version__} cuda {torch.version.cuda} python {sys.version.split()[0]}")
for name in ("megatron.core", "transformer_engine.pytorch", "flash_attn", "flash_attn.cute", "liger_kernel", "quack", "apex", "scaled_masked_softmax_cuda", "matplotlib", "scipy", "pytest"):
    try:
        m = importlib.import_module(name)
        print(f"import {name}: ok {getattr(m, '__version__', '')}")
    except Exception as error:  # noqa: BLE001
        print(f"import {name}: no ({type(error).__name__}: {str(error)[:120]})")
PY
}

install() {
  if [ -z "$WHEELS" ]; then
    if "$PYTHON" -c 'import megatron.core' 2>/dev/null; then
      echo "no --wheels directory: nothing installed (megatron-core already imports)"
      "$PYTHON" -c 'import torch; from megatron_epp.executor import kernels; kernels.select_backend("auto", torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16)'
      return 0
    fi
    echo "error: megatron-core does not import and no --wheels directory was given (offline: carry its wheel)"; return 1
  fi
  bash scripts/setup_gpu.sh --wheels "$WHEELS" --build-timeout "$BUILD_TIMEOUT" $QUICK_SETUP --log-dir "$OUT_DIR/install"
}

train() {  # train [METRICS_NAME [PORT]]: the training check, its metrics in OUT_DIR/METRICS_NAME (default metrics.jsonl)
  local metrics="$OUT_DIR/${1:-metrics.jsonl}" port=${2:-29517} profile=(--epp-profile llama-7b) name=${1:-metrics.jsonl} trace=()
  name=${name%.jsonl}
  [ "$QUICK" = 1 ] && trace=(--profile --use-pytorch-profiler --profile-step-start "$TRACE_ITERATION" --profile-step-end $((TRACE_ITERATION + 1))
                              --tensorboard-dir "$OUT_DIR/tb-$name")
  [ "$REHEARSAL" = 1 ] && profile=(--epp-profile test-model)
  [ -s "$OUT_DIR/profile.json" ] && profile=(--epp-profile "$OUT_DIR/profile.json")
  [ "$QUICK" = 1 ] && profile=()  # the default path: --epp-profile auto
  rm -f "$metrics"
  "$PYTHON" -m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 --master-port "$port" pretrain_gpt.py \
    "${TRAIN_FLAGS[@]}" "${profile[@]}" "${trace[@]}" "${@:3}" --epp-metrics "$metrics" || return $?
  if [ "$QUICK" = 1 ]; then  # the traced iteration by kernel class (the trace itself stays in OUT_DIR/tb-NAME)
    "$PYTHON" -m benchmarks.trace_kernels "$OUT_DIR/tb-$name" --iteration "$TRACE_ITERATION" > "$OUT_DIR/trace_$name.json" || echo "trace_kernels: no trace summary"
  fi
  "$PYTHON" -m benchmarks.gpu_check_report --train "$metrics" $([ "$QUICK" = 1 ] && echo --default-path)
}

offload() {  # issue 41 on a GPU: K/V buffers on the host through the CUDA block kernel, then the train step's run
  # (its batches) with the recompute checkpoints the planner chooses to offload, on the copy bandwidth measured at start-up
  local rc=0
  "$PYTHON" -m benchmarks.check_kv_host_cuda "${KV_HOST_FLAGS[@]}" || rc=$?
  train metrics_offload.jsonl 29519 --epp-offload checkpoints || rc=$?
  return $rc
}

baseline() {  # the train step's run with the kernels before flash-attn-4 and the fused pointwise ops
  env "${BASELINE_ENV[@]}" bash -c "$(declare -p PYTHON OUT_DIR TRAIN_FLAGS TRACE_ITERATION REHEARSAL QUICK); $(declare -f train); train metrics_baseline.jsonl 29518 $([ ${#BASELINE_FLAGS[@]} = 0 ] || printf '%q ' "${BASELINE_FLAGS[@]}")"
}

echo "gpu_check.sh: steps $STEPS; output in $OUT_DIR"
wanted facts && run_step facts facts
wanted install && run_step install install
wanted attention && run_step attention "$PYTHON" -m benchmarks.check_cuda_attention "${ATTENTION_FLAGS[@]}"
wanted equivalence && run_step equivalence "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/integration/test_elastic_equivalence.py "${EQUIVALENCE_SELECTION[@]}"
wanted fused && run_step fused "$PYTHON" -m benchmarks.fused_kernels "${FUSED_FLAGS[@]}"
wanted profile && run_step profile "$PYTHON" -m megatron_epp.measure.profile_gpu "${PROFILE_FLAGS[@]}" --out "$OUT_DIR/profile.json"
wanted train && run_step train train
wanted baseline && run_step baseline baseline
wanted offload && run_step offload offload
wanted longest && run_step longest "$PYTHON" -m benchmarks.longest_trainable "${LONGEST_FLAGS[@]}"
wanted bench && run_step bench "$PYTHON" -m benchmarks.bench_gpu "${BENCH_FLAGS[@]}"

{
  echo "gpu_check.sh summary ($(date -u +%FT%TZ)), output in $OUT_DIR"
  for line in "${RESULTS[@]}"; do echo "  $line"; done
} | tee "$OUT_DIR/summary.txt"
"$PYTHON" -m benchmarks.gpu_check_report "$OUT_DIR" | tee "$OUT_DIR/report.json" | tail -n 1
exit $FAILED
