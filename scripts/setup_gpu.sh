#!/usr/bin/env bash
# GPU machine set-up, against the torch already installed there:
#   1. checks torch (>= 2.6, a CUDA build, sees a GPU; says which driver its CUDA build needs),
#   2. installs requirements-gpu.txt (megatron-core and the libraries; never replaces torch),
#   3. then each optional kernel package on its own: Transformer Engine, flash-attn. A failed or
#      timed-out build, or one that installs but does not import, is a warning: it is uninstalled
#      (megatron-core would otherwise trip over a half-working TE) and the library falls back
#      (stock path: local layer spec; elastic attention: SDPA),
#   4. the kernels that need no build (requirements-gpu-kernels.txt: flash-attn-4 and its CuTe DSL libraries,
#      liger-kernel, quack-kernels): each one not yet installed, with --no-deps (torch's triton pin and the installed
#      CUDA libraries stay as they are; a triton that changed anyway is an error); where flash_attn.cute does not
#      import afterwards it is a warning, what was installed is removed again, and the attention falls back,
#   5. prints what the library will use (the same probes training uses).
# Exit 0 when the runtime is usable (warnings or not), 1 when the runtime itself did not install,
# 2 on a bad option.
#
#   bash scripts/setup_gpu.sh [--wheels DIR | --find-links DIR] [--build-timeout S] [--no-te] [--no-flash] [--no-kernels] [--log-dir DIR]
#
#   --wheels DIR       offline: install only from the wheels in DIR and its parts DIR/1, DIR/2, ... (scripts/gpu_wheels.sh
#                      lays them out; pieces NAME.part-00, NAME.part-01, ... are joined first)
#   --find-links DIR   offline: install only from the wheels/sdists in DIR (pip --no-index)
#   --build-timeout S  seconds each optional package may take to install, build included (default
#                      3600; 0: wheels only, nothing is compiled). flash-attn from source takes
#                      10-25 min on 16 cores even for one GPU architecture.
#   --no-te, --no-flash  leave that optional package out
#   --no-kernels       leave requirements-gpu-kernels.txt out
#   --log-dir DIR      where pip's logs go (default: a new temporary directory)
# Environment: PYTHON (default python3), PIP (default "$PYTHON -m pip"), MAX_JOBS / NVCC_THREADS
# (parallel build jobs; default: cores, and cores' worth of memory at 4 GB a job), FLASH_ATTN_CUDA_ARCHS /
# TORCH_CUDA_ARCH_LIST (default: the visible GPU's architecture only).
set -uo pipefail
cd "$(dirname "$0")/.."

# The optional kernels (one place for their versions; requirements-gpu.txt names them too).
TE_SPEC="transformer-engine[pytorch]==2.12.0"
FLASH_SPEC="flash-attn>=2.8.3.post2"
TE_DISTRIBUTIONS=(transformer-engine transformer-engine-torch transformer-engine-cu12 transformer-engine-cu13)

PYTHON=${PYTHON:-python3}
read -ra PIP <<< "${PIP:-$PYTHON -m pip}"
FIND_LINKS="" WHEEL_PARTS="" BUILD_TIMEOUT=3600 WANT_TE=1 WANT_FLASH=1 WANT_KERNELS=1 LOG_DIR=""

usage_error() { echo "setup_gpu.sh: error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --find-links) [ $# -ge 2 ] || usage_error "--find-links needs a directory"; FIND_LINKS=$2; shift 2 ;;
    --wheels) [ $# -ge 2 ] || usage_error "--wheels needs a directory"; FIND_LINKS=$2; WHEEL_PARTS=1; shift 2 ;;
    --no-kernels) WANT_KERNELS=0; shift ;;
    --build-timeout) [ $# -ge 2 ] || usage_error "--build-timeout needs seconds"; BUILD_TIMEOUT=$2; shift 2 ;;
    --log-dir) [ $# -ge 2 ] || usage_error "--log-dir needs a directory"; LOG_DIR=$2; shift 2 ;;
    --no-te) WANT_TE=0; shift ;;
    --no-flash) WANT_FLASH=0; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) usage_error "unknown option $1 (see --help)" ;;
  esac
done
[ -z "$FIND_LINKS" ] || [ -d "$FIND_LINKS" ] || usage_error "--find-links $FIND_LINKS: no such directory"
[[ "$BUILD_TIMEOUT" =~ ^[0-9]+$ ]] || usage_error "--build-timeout $BUILD_TIMEOUT: expected whole seconds"
LOG_DIR=${LOG_DIR:-$(mktemp -d -t epp-setup-gpu.XXXXXX)}
mkdir -p "$LOG_DIR" || usage_error "--log-dir $LOG_DIR: cannot create it"
if [ -n "$WHEEL_PARTS" ]; then  # the wheels of DIR and its parts in one folder, pieces joined
  JOINED="$LOG_DIR/wheels"
  mkdir -p "$JOINED"
  for wheel in "$FIND_LINKS"/*.whl "$FIND_LINKS"/*.tar.gz "$FIND_LINKS"/[0-9]*/*.whl; do
    [ -e "$wheel" ] && ln -sf "$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")" "$JOINED/"
  done
  for first in "$FIND_LINKS"/*.whl.part-00 "$FIND_LINKS"/[0-9]*/*.whl.part-00; do
    [ -e "$first" ] || continue
    name=$(basename "${first%.part-00}")
    pieces=$(ls "$FIND_LINKS"/"$name".part-* "$FIND_LINKS"/[0-9]*/"$name".part-* 2>/dev/null | awk -F'.part-' '{print $NF "\t" $0}' | sort | cut -f2)
    # shellcheck disable=SC2086
    cat $pieces > "$JOINED/$name" || usage_error "--wheels $FIND_LINKS: could not join the pieces of $name"
    echo "setup_gpu.sh: $name joined from $(echo "$pieces" | wc -l) pieces"
  done
  FIND_LINKS=$JOINED
fi
SOURCE=()
[ -z "$FIND_LINKS" ] || SOURCE=(--no-index --find-links "$FIND_LINKS")

WARNINGS=()
say() { echo "setup_gpu.sh: $*"; }
warn() { echo "setup_gpu.sh: WARNING: $*" >&2; WARNINGS+=("$*"); }
die() { echo "setup_gpu.sh: error: $*" >&2; exit 1; }

# 1. torch ------------------------------------------------------------------------------------
TORCH_FACTS=$("$PYTHON" - <<'PY' 2>&1
import shlex, shutil, subprocess
try:
    import torch
except Exception as error:  # noqa: BLE001
    print(f"TORCH_ERROR={shlex.quote(f'{type(error).__name__}: {error}')}")
    raise SystemExit
# CUDA major -> the oldest driver that runs it (13.x: 580; 12.x: 525 through CUDA's minor-version
# compatibility; 11.x: 450)
NEEDS = {13: "580", 12: "525", 11: "450"}
cuda = torch.version.cuda or ""
driver = ""
if shutil.which("nvidia-smi"):
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
    except Exception:  # noqa: BLE001
        driver = ""
available = torch.cuda.is_available()
arch = ""
if available:
    major, minor = torch.cuda.get_device_capability(0)
    arch = f"{major}.{minor}"
version = torch.__version__.split("+")[0]
parts = [int(p) if p.isdigit() else 0 for p in version.split(".")[:2]]
facts = {
    "TORCH_VERSION": torch.__version__, "TORCH_OK": int(tuple(parts) >= (2, 6)), "TORCH_CUDA": cuda,
    "DRIVER_NEEDED": NEEDS.get(int(cuda.split(".")[0]), "?") if cuda else "", "DRIVER": driver,
    "CUDA_OK": int(available), "GPUS": torch.cuda.device_count() if available else 0, "GPU_ARCH": arch,
    "GPU_NAME": torch.cuda.get_device_name(0) if available else "",
}
for key, value in facts.items():
    print(f"{key}={shlex.quote(str(value))}")
PY
)
TORCH_ERROR="" TORCH_VERSION="" TORCH_OK=0 TORCH_CUDA="" DRIVER_NEEDED="" DRIVER="" CUDA_OK=0 GPUS=0 GPU_ARCH="" GPU_NAME=""
eval "$(grep -E '^[A-Z_]+=' <<< "$TORCH_FACTS")" || die "could not read torch's facts: $TORCH_FACTS"
HOW_TO_TORCH="install a CUDA build of torch >= 2.6 first, matching the driver: 'pip install torch==2.13.0' is CUDA 13.0 (driver >= 580); for an older driver take a CUDA 12 build from PyTorch's own index, e.g. 'pip install torch --index-url https://download.pytorch.org/whl/cu126' (driver >= 525)"
[ -z "$TORCH_ERROR" ] || die "torch does not import ($TORCH_ERROR): $HOW_TO_TORCH"
[ "$TORCH_OK" = 1 ] || die "torch $TORCH_VERSION is older than 2.6 (megatron-core 0.16.1's floor): $HOW_TO_TORCH"
if [ -z "$TORCH_CUDA" ]; then
  warn "torch $TORCH_VERSION is a CPU build: the library runs on CPU only, and the optional GPU kernels below will most likely not build; $HOW_TO_TORCH"
elif [ "$CUDA_OK" != 1 ]; then
  warn "torch $TORCH_VERSION is a CUDA $TORCH_CUDA build, which needs NVIDIA driver >= $DRIVER_NEEDED, and torch.cuda.is_available() is False (driver: ${DRIVER:-none found by nvidia-smi}); on an older driver use another CUDA build of torch: $HOW_TO_TORCH"
else
  say "torch $TORCH_VERSION (CUDA $TORCH_CUDA, driver ${DRIVER:-?}, needs >= $DRIVER_NEEDED): $GPUS GPU(s), $GPU_NAME (sm ${GPU_ARCH})"
fi

# 2. the runtime ------------------------------------------------------------------------------
say "installing requirements-gpu.txt${FIND_LINKS:+ from $FIND_LINKS only} (log: $LOG_DIR/requirements.log)"
if ! "${PIP[@]}" install --disable-pip-version-check "${SOURCE[@]}" -r requirements-gpu.txt > "$LOG_DIR/requirements.log" 2>&1; then
  tail -n 15 "$LOG_DIR/requirements.log" >&2
  die "requirements-gpu.txt did not install (log above and in $LOG_DIR/requirements.log)${FIND_LINKS:+; offline, $FIND_LINKS must hold the wheel of every missing package (megatron-core 0.16.1 at least)}"
fi

# 3. optional kernels -------------------------------------------------------------------------
probe() {  # probe MODULE: prints the version, or why it does not import (exit 1)
  "$PYTHON" - "$1" <<'PY' 2>&1
import importlib, sys
name = sys.argv[1]
try:
    module = importlib.import_module(name)
except Exception as error:  # noqa: BLE001
    print(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    raise SystemExit(1)
top = importlib.import_module(name.split(".")[0])
print(getattr(top, "__version__", "unknown version"))
PY
}

build_env() {  # the parallelism and architectures of a CUDA extension build
  local cores mem_gb jobs
  cores=$(nproc 2>/dev/null || echo 4)
  mem_gb=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 16)
  jobs=$(( mem_gb / 4 < cores ? mem_gb / 4 : cores )); [ "$jobs" -ge 1 ] || jobs=1
  BUILD_ENV=("MAX_JOBS=${MAX_JOBS:-$jobs}" "NVCC_THREADS=${NVCC_THREADS:-2}")
  if [ -n "$GPU_ARCH" ]; then  # this GPU's architecture only: a fraction of the default build
    BUILD_ENV+=("TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$GPU_ARCH}" "FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS:-${GPU_ARCH/./}}" "NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-${GPU_ARCH/./}}")
  fi
}

STATUS=()
install_optional() {  # install_optional LABEL MODULE SPEC FALLBACK UNINSTALL... -- ENV...
  local label=$1 module=$2 spec=$3 fallback=$4; shift 4
  local remove=() env_vars=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do remove+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  env_vars=("$@")
  local found
  if found=$(probe "$module"); then
    say "$label: already importable ($found)"; STATUS+=("$label: $found (already installed)"); return
  fi
  local log="$LOG_DIR/${label// /_}.log" binary=() limit=$BUILD_TIMEOUT
  if [ "$BUILD_TIMEOUT" = 0 ]; then binary=(--only-binary :all:); limit=600; fi
  say "$label: installing $spec${binary:+ (wheels only)}${FIND_LINKS:+ from $FIND_LINKS} (limit ${limit} s; log: $log)"
  local start=$SECONDS rc=0
  # --no-build-isolation: build against the installed torch (an isolated build would fetch the newest
  # torch, or none offline; flash-attn's setup.py imports torch)
  timeout -k 30 "$limit" env "${env_vars[@]}" "${PIP[@]}" install --disable-pip-version-check --no-build-isolation \
    "${SOURCE[@]}" "${binary[@]}" "$spec" > "$log" 2>&1 || rc=$?
  local why=""
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    why="stopped after $((SECONDS - start)) s (--build-timeout $BUILD_TIMEOUT)"
  elif [ "$rc" != 0 ]; then
    why="pip failed (exit $rc): $(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200)"
  elif ! found=$(probe "$module"); then
    why="installed but $module does not import ($found)"
  fi
  if [ -z "$why" ]; then
    say "$label: $found installed in $((SECONDS - start)) s"; STATUS+=("$label: $found"); return
  fi
  # a half-installed package (TE's core without its PyTorch extension, a flash-attn built against
  # another torch) is removed: megatron-core and others probe these imports and may trip over it
  "${PIP[@]}" uninstall -y "${remove[@]}" >> "$log" 2>&1 || true
  warn "$label not available: $why; $spec removed again, the library falls back: $fallback (log: $log)"
  STATUS+=("$label: not available")
}

build_env
if [ "$WANT_TE" = 1 ]; then
  install_optional "transformer-engine" transformer_engine.pytorch "$TE_SPEC" "stock path on the local layer spec" "${TE_DISTRIBUTIONS[@]}" -- \
    "${BUILD_ENV[@]}" NVTE_FRAMEWORK=pytorch
else
  STATUS+=("transformer-engine: skipped (--no-te)")
fi
if [ "$WANT_FLASH" = 1 ]; then
  # offline, flash-attn's setup.py would first try to download a prebuilt wheel: build straight away
  install_optional "flash-attn" flash_attn "$FLASH_SPEC" "elastic attention on SDPA" flash-attn -- \
    "${BUILD_ENV[@]}" ${FIND_LINKS:+FLASH_ATTENTION_FORCE_BUILD=TRUE}
else
  STATUS+=("flash-attn: skipped (--no-flash)")
fi

# 4. the kernels without a build (requirements-gpu-kernels.txt) ------------------------------------
dist_version() {  # dist_version NAME: the installed version, or nothing
  "$PYTHON" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1" 2>/dev/null
}
install_kernels() {
  local log="$LOG_DIR/kernels.log" missing=() installed=() triton_before triton_after found why=""
  mapfile -t missing < <("$PYTHON" - <<'PY'  # the pinned specs whose distribution is not installed (one interpreter start)
import importlib.metadata as m
for line in open("requirements-gpu-kernels.txt"):
    spec = line.split("#")[0].strip()
    if spec:
        try:
            m.version(spec.split("==")[0])
        except m.PackageNotFoundError:
            print(spec)
PY
)
  if [ ${#missing[@]} = 0 ]; then
    say "kernels: requirements-gpu-kernels.txt already installed"
  else
    triton_before=$(dist_version triton)
    say "kernels: installing ${#missing[@]} of requirements-gpu-kernels.txt with --no-deps${FIND_LINKS:+ from $FIND_LINKS} (log: $log)"
    if "${PIP[@]}" install --disable-pip-version-check --no-deps "${SOURCE[@]}" "${missing[@]}" > "$log" 2>&1; then
      installed=("${missing[@]%%==*}")
    else
      why="pip failed: $(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200)"
    fi
    triton_after=$(dist_version triton)
    [ "$triton_before" = "$triton_after" ] || die "triton changed from ${triton_before:-none} to ${triton_after:-none} (torch pins its own): reinstall triton==$triton_before"
  fi
  if [ -z "$why" ] && ! found=$(probe flash_attn.cute); then
    why="flash_attn.cute does not import ($found)"
  fi
  if [ -n "$why" ]; then
    [ ${#installed[@]} = 0 ] || "${PIP[@]}" uninstall -y "${installed[@]}" >> "$log" 2>&1 || true
    warn "kernels not available: $why; what was installed is removed again, the elastic attention falls back to the kernels before flash-attn-4 (log: $log)"
    STATUS+=("kernels (flash-attn-4, liger-kernel, quack-kernels): not available")
    return
  fi
  STATUS+=("kernels: flash-attn-4 $(dist_version flash-attn-4), liger-kernel $(dist_version liger-kernel), quack-kernels $(dist_version quack-kernels)")
}
if [ "$WANT_KERNELS" = 1 ]; then
  install_kernels
else
  STATUS+=("kernels: skipped (--no-kernels)")
fi

# 5. what the library will use (its own probes) ------------------------------------------------
say "summary:"
for s in "${STATUS[@]}"; do echo "  $s"; done
"$PYTHON" - <<'PY' || die "the library does not import after the install (traceback above; a broken transformer_engine that pip could not remove breaks megatron-core itself: pip uninstall ${TE_DISTRIBUTIONS[*]})"
import torch

from megatron_epp.executor import kernels
from megatron_epp.executor.extensions import probe_fused_softmax, probe_transformer_engine
from megatron_epp.model.gpt import layer_spec_summary

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
print(f"  torch {torch.__version__} on {device.type}" + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""))
print(f"  transformer-engine layers: {probe_transformer_engine() or 'import'}")
print(f"  fused softmax kernels: {probe_fused_softmax() or 'import'}")
print(f"  stock path: {layer_spec_summary(elastic=False)}")
print(f"  --elastic-pp: {layer_spec_summary(elastic=True)}")
kernels.select_backend("auto", device, dtype, gqa=True, heads=(32, 8, 128))  # flash-attn-4 probed (and compiled) at 32:8 heads of 128; prints '> elastic attention: <kernel> (...)'
PY
if [ ${#WARNINGS[@]} -gt 0 ]; then
  say "done with ${#WARNINGS[@]} warning(s) (above); logs in $LOG_DIR"
else
  say "done; logs in $LOG_DIR"
fi
exit 0
