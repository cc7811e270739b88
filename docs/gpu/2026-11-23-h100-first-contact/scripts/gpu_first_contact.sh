#!/usr/bin/env bash
# First contact of megatron-epp with a GPU (helper; not part of the repo).
#   bash .gpu/gpu_first_contact.sh call1|call2|dry   (from the root of the carried tree; writes under $OUT)
# Every step is time-boxed and the script goes on after a failure; step logs go to /tmp/epp_steps and
# are tarred into $OUT/steps.tgz after every step; $OUT/summary.txt has one line per step.
# Experiments run on CPUs 0-3 (taskset); the background flash-attn build on CPUs 4-15 (nice 10).
set -u
MODE=${1:-call1}
G=$(cd "$(dirname "$0")" && pwd)
R=$G/repo
OUT=${OUT:-/tmp/epp_out}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${BUDGET:-535}
STEPS=/tmp/epp_steps
mkdir -p $STEPS
SUM=$OUT/summary.txt
CPUS=${CPUS:-0-3}
BUILD_CPUS=${BUILD_CPUS:-4-15}
BUILD_JOBS=${BUILD_JOBS:-12}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore EPP_REPO=$R
export PYTHONPATH=/tmp/site:$R
export OMP_NUM_THREADS=4
PY=${PY:-python3}
FA_SDIST=$G/flash_attn-2.8.3.post2.tar.gz
FA_DIR=/tmp/fa/flash_attn-2.8.3.post2

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
note() { echo "$*" | tee -a "$SUM"; }

# step NAME TIMEOUT NEED cmd...: run cmd (in $R) with min(TIMEOUT, time left - 5) seconds, if >= NEED s are left.
step() {
  local name=$1 t=$2 need=$3; shift 3
  local l; l=$(left)
  if (( l < need )); then note "SKIP $name: ${l}s left, needs ${need}s"; return 0; fi
  (( t > l - 5 )) && t=$(( l - 5 ))
  echo "=== STEP $name (timeout ${t}s, $(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg)): $*"
  local s; s=$(date +%s%N)
  ( cd "$R" && timeout -k 5 "$t" taskset -c "$CPUS" "$@" ) > "$STEPS/$name.log" 2>&1
  local rc=$?
  local dt=$(( ($(date +%s%N) - s) / 1000000 ))
  grep -v -E 'warnings.warn\(|UserWarning|FutureWarning' "$STEPS/$name.log" | tail -n "${TAIL:-30}"
  echo "=== END $name rc=$rc $((dt / 1000)).$(( (dt % 1000) / 100 ))s"
  note "$name rc=$rc $((dt / 1000)).$(( (dt % 1000) / 100 ))s$( ((rc == 124 || rc == 137)) && echo ' (TIMEOUT)')"
  if (( rc != 0 )); then
    grep -v -E 'warnings.warn\(|UserWarning|FutureWarning' "$STEPS/$name.log" | tail -n 4 | sed 's/^/    | /' | cut -c1-400 >> "$SUM"
  fi
  tar czf "$OUT/steps.tgz" -C /tmp epp_steps 2>/dev/null
  return 0
}

install_megatron() {
  if $PY -c 'import megatron.core' 2>/dev/null; then echo "megatron.core already importable"; return 0; fi
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/whl/*.whl \
    && $PY -c 'import megatron.core as m; print("megatron.core", m.__version__, m.__file__)'
}

start_flash_build() {
  [ -f /tmp/fa_start ] && { echo "flash build already started $(( $(date +%s) - $(cat /tmp/fa_start) ))s ago"; return 0; }
  [ -f "$FA_SDIST" ] || { echo "no flash sdist"; return 1; }
  mkdir -p /tmp/fa /tmp/fa_whl && tar xzf "$FA_SDIST" -C /tmp/fa || return 1
  date +%s > /tmp/fa_start
  ( cd "$FA_DIR" && setsid nohup taskset -c "$BUILD_CPUS" nice -n 10 env FLASH_ATTENTION_FORCE_BUILD=TRUE \
      FLASH_ATTN_CUDA_ARCHS=90 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$BUILD_JOBS NVCC_THREADS=2 \
      bash -c "$PY -m pip wheel -v --no-build-isolation --no-deps --no-index -w /tmp/fa_whl . > /tmp/fa_build.log 2>&1; echo \$? > /tmp/fa_rc; date +%s > /tmp/fa_end" \
      > /dev/null 2>&1 < /dev/null & )
  echo "flash-attn build started in the background (MAX_JOBS=$BUILD_JOBS on CPUs $BUILD_CPUS)"
}

flash_status() {
  local objs total now
  now=$(date +%s)
  objs=$(find /tmp/fa -name '*.o' 2>/dev/null | wc -l)
  total=$(ls "$FA_DIR"/csrc/flash_attn/src/*.cu 2>/dev/null | wc -l)
  if [ -f /tmp/fa_end ]; then
    note "flash build: finished rc=$(cat /tmp/fa_rc) after $(( $(cat /tmp/fa_end) - $(cat /tmp/fa_start) ))s; objects $objs (of $total .cu + flash_api.cpp); wheels: $(ls /tmp/fa_whl 2>/dev/null | tr '\n' ' ')"
  elif [ -f /tmp/fa_start ]; then
    note "flash build: RUNNING for $(( now - $(cat /tmp/fa_start) ))s; objects $objs (of $total .cu + flash_api.cpp); nvcc/cicc processes: $(pgrep -c -f 'cicc|ptxas|nvcc' || true)"
  else
    note "flash build: not started"
  fi
  [ -f /tmp/fa_build.log ] && { grep -E -i 'error|FAILED|Killed' /tmp/fa_build.log | tail -n 15; tail -n 15 /tmp/fa_build.log | cut -c1-300; cp /tmp/fa_build.log "$OUT/flash_build.log" 2>/dev/null; }
  free -g | head -2
}

flash_ready() { [ -f /tmp/fa_rc ] && [ "$(cat /tmp/fa_rc)" = 0 ] && ls /tmp/fa_whl/flash_attn-*.whl >/dev/null 2>&1; }

TRAIN="-m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 pretrain_gpt.py"
MODEL="--mock-data --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 16384 --global-batch-size 32 --lr 3e-4 --lr-warmup-iters 2 --log-interval 1"
EPP="--elastic-pp --pipeline-model-parallel-size 1"
EQM="--mock-data --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64"
EQS="--mock-data --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 2048 --max-position-embeddings 2048"
EQ=/tmp/epp_eq
if [ "${DRY:-0}" = 1 ]; then  # CPU check of the script's logic at toy sizes
  MODEL="--mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 512 --global-batch-size 8 --lr 3e-4 --lr-warmup-iters 1 --log-interval 1"
  EQS="--mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256"
  TIGHT=0.05
else
  TIGHT=4
fi
SCALE=$([ "${DRY:-0}" = 1 ] && echo 4 || echo 32)

optional_steps() {  # run whichever of these has not run on this machine yet
  [ -f $STEPS/train_bf16_default_profile.log ] || step train_bf16_default_profile 110 60 $PY $TRAIN $EPP $MODEL --bf16 --train-iters 8
  [ -f $STEPS/train_fp32_llama7b.log ] || step train_fp32_llama7b 110 60 $PY $TRAIN $EPP $MODEL --epp-profile llama-7b --train-iters 8
  [ -f $STEPS/stock_bf16_seq8192.log ] || step stock_bf16_seq8192 70 40 $PY $TRAIN --pipeline-model-parallel-size 1 --bf16 --mock-data --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 8192 --global-batch-size 8 --train-iters 3 --log-interval 1
}

equivalence() {  # $1: label suffix; runs reference fp32 (once per machine) and elastic fp32/bf16
  local sfx=$1
  mkdir -p $EQ
  if [ ! -d $EQ/ref32 ]; then
    mkdir -p $EQ/ref32 $EQ/refS32
    step eq_ref32 60 30 $PY $G/equiv_worker.py $EQ/ref32 --mode reference --cases 8 $EQM
    EPP_EQUIV_SCALE=$SCALE step eq_refS32 60 30 $PY $G/equiv_worker.py $EQ/refS32 --mode reference --cases 6 $EQS
  fi
  if [ -z "$sfx" ]; then
    mkdir -p $EQ/el32 $EQ/el32rc $EQ/elS32
    step eq_el32 60 30 $PY $G/equiv_worker.py $EQ/el32 --mode elastic --cases 8 $EQM
    step eq_el32_recompute 60 30 $PY $G/equiv_worker.py $EQ/el32rc --mode elastic --cases 8 $EQM --random-recompute
    EPP_EQUIV_SCALE=$SCALE step eq_elS32 60 30 $PY $G/equiv_worker.py $EQ/elS32 --mode elastic --cases 6 $EQS
  fi
  mkdir -p $EQ/el16$sfx $EQ/elS16$sfx
  step eq_el16$sfx 60 30 $PY $G/equiv_worker.py $EQ/el16$sfx --mode elastic --cases 8 $EQM --bf16
  EPP_EQUIV_SCALE=$SCALE step eq_elS16$sfx 60 30 $PY $G/equiv_worker.py $EQ/elS16$sfx --mode elastic --cases 6 $EQS --bf16
  local pairs="bf16_elastic_vs_fp32_ref$sfx=$EQ/ref32:$EQ/el16$sfx:8 bf16_elastic_vs_fp32_ref_x${SCALE}$sfx=$EQ/refS32:$EQ/elS16$sfx:6"
  [ -z "$sfx" ] && pairs="fp32_elastic_vs_fp32_ref=$EQ/ref32:$EQ/el32:8 fp32_recompute_vs_fp32_ref=$EQ/ref32:$EQ/el32rc:8 fp32_elastic_vs_fp32_ref_x${SCALE}=$EQ/refS32:$EQ/elS32:6 $pairs"
  TAIL=20 step eq_compare$sfx 60 10 $PY $G/equiv_compare.py "$OUT/equiv$sfx.json" $pairs
}

echo "### gpu_first_contact $MODE start $(date -u +%FT%TZ) budget ${BUDGET}s host $(hostname)"
case "$MODE" in
call1)
  TAIL=60 step facts 60 0 bash -c "nvidia-smi; nvcc --version | tail -n 2; which nvcc python3 torchrun ninja; nproc; free -g | head -2; $PY $G/facts.py; $PY -m pip list 2>/dev/null | grep -i -E '^(torch|triton|numpy|scipy|packaging|tokenizers|psutil|einops|setuptools|wheel|ninja|tensorboard) '"
  TAIL=5 step install 120 0 bash -c "$(declare -f install_megatron); G=$G PY=$PY install_megatron"
  [ "$MODE" = call1 ] && start_flash_build
  TAIL=10 step check_cuda_attention_asis 120 20 $PY scripts/check_cuda_attention.py
  TAIL=30 step attn_sdpa_nofl 150 40 $PY $G/attn_check_nofl.py --json $OUT/attn_sdpa.json $([ "${DRY:-0}" = 1 ] && echo --cpu-dry-run)
  step train_bf16_llama7b 150 60 $PY $TRAIN $EPP $MODEL --bf16 --epp-profile llama-7b --train-iters 15
  step train_bf16_llama7b_tight 130 60 $PY $TRAIN $EPP $MODEL --bf16 --epp-profile llama-7b --epp-memory-budget $TIGHT --train-iters 12
  step stock_bf16_seq4096 70 30 $PY $TRAIN --pipeline-model-parallel-size 1 --bf16 --mock-data --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 4096 --global-batch-size 8 --train-iters 3 --log-interval 1
  equivalence ""
  TAIL=40 step layer_grid 200 60 $PY $G/layer_grid.py --json "$OUT/grid.json" --budget-s 150 $([ "${DRY:-0}" = 1 ] && echo --cpu-dry-run)
  optional_steps
  flash_status
  ;;
call2)
  # after call 1: bf16 fix in repo/megatron_epp/training/model.py, reference batches on the device in the
  # equivalence worker; no flash build (14 of 73 objects after 385 s in call 1)
  TAIL=5 step install2 120 0 bash -c "$(declare -f install_megatron); G=$G PY=$PY install_megatron"
  step train_bf16_llama7b 120 60 $PY $TRAIN $EPP $MODEL --bf16 --epp-profile llama-7b --train-iters 15
  step train_bf16_llama7b_tight 120 60 $PY $TRAIN $EPP $MODEL --bf16 --epp-profile llama-7b --epp-memory-budget $TIGHT --train-iters 12
  mkdir -p $EQ/ref32 $EQ/refS32 $EQ/el32rc $EQ/elS32 $EQ/el16 $EQ/elS16
  step eq_ref32 60 30 $PY $G/equiv_worker.py $EQ/ref32 --mode reference --cases 8 $EQM
  step eq_el32_recompute 60 30 $PY $G/equiv_worker.py $EQ/el32rc --mode elastic --cases 8 $EQM --random-recompute
  step eq_el16 60 30 $PY $G/equiv_worker.py $EQ/el16 --mode elastic --cases 8 $EQM --bf16
  EPP_EQUIV_SCALE=$SCALE step eq_refS32 60 30 $PY $G/equiv_worker.py $EQ/refS32 --mode reference --cases 6 $EQS
  EPP_EQUIV_SCALE=$SCALE step eq_elS32 60 30 $PY $G/equiv_worker.py $EQ/elS32 --mode elastic --cases 6 $EQS
  EPP_EQUIV_SCALE=$SCALE step eq_elS16 60 30 $PY $G/equiv_worker.py $EQ/elS16 --mode elastic --cases 6 $EQS --bf16
  TAIL=20 step eq_compare 60 10 $PY $G/equiv_compare.py "$OUT/equiv.json" fp32_elastic_recompute_vs_fp32_ref=$EQ/ref32:$EQ/el32rc:8 \
    bf16_elastic_vs_fp32_ref=$EQ/ref32:$EQ/el16:8 fp32_elastic_vs_fp32_ref_x$SCALE=$EQ/refS32:$EQ/elS32:6 bf16_elastic_vs_fp32_ref_x$SCALE=$EQ/refS32:$EQ/elS16:6
  TAIL=40 step layer_grid 170 60 $PY $G/layer_grid.py --json "$OUT/grid.json" --budget-s ${GRID_S:-125} $([ "${DRY:-0}" = 1 ] && echo --cpu-dry-run)
  step stock_bf16_seq4096 60 30 $PY $TRAIN --pipeline-model-parallel-size 1 --bf16 --mock-data --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 4096 --global-batch-size 8 --train-iters 3 --log-interval 1
  step train_bf16_default_profile 90 50 $PY $TRAIN $EPP $MODEL --bf16 --train-iters 8
  step stock_bf16_seq8192 60 35 $PY $TRAIN --pipeline-model-parallel-size 1 --bf16 --mock-data --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 8192 --global-batch-size 8 --train-iters 3 --log-interval 1
  ;;
esac
echo "### gpu_first_contact $MODE end $(date -u +%FT%TZ) after $(( $(date +%s) - T0 ))s"
cat "$SUM"
