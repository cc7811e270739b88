#!/usr/bin/env bash
# Here (with PyPI), for an offline GPU machine: download megatron-core's cp312 wheel and the GPU kernels of
# requirements-gpu-kernels.txt (flash-attn-4 and its CuTe DSL libraries, liger-kernel, quack-kernels), and lay them out
# in parts DIR/1, DIR/2, ... of at most --part-mib MiB each (the device tool carries 64 MiB a call, the working tree of about 5 MiB included), a wheel larger than
# a part cut into pieces (NAME.part-00, NAME.part-01, ...) that scripts/setup_gpu.sh --wheels DIR joins again.
#
#   bash scripts/gpu_wheels.sh [--dir .whl] [--part-mib 56] [--no-kernels]
#
# Carry DIR/1 with the first call, DIR/2 with the next (a warm machine keeps what the first brought), then run
# 'bash scripts/setup_gpu.sh --wheels DIR' (or gpu_check.sh --wheels DIR) there. Exit 0 when every wheel downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=.whl PART_MIB=56 KERNELS=1
usage_error() { echo "gpu_wheels.sh: error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) [ $# -ge 2 ] || usage_error "--dir needs a directory"; DIR=$2; shift 2 ;;
    --part-mib) [ $# -ge 2 ] || usage_error "--part-mib needs a size"; PART_MIB=$2; shift 2 ;;
    --no-kernels) KERNELS=0; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) usage_error "unknown option $1 (see --help)" ;;
  esac
done
[[ "$PART_MIB" =~ ^[0-9]+$ ]] && [ "$PART_MIB" -ge 8 ] || usage_error "--part-mib $PART_MIB: expected whole MiB, at least 8"
PYTHON=${PYTHON:-python3}
read -ra PIP <<< "${PIP:-$PYTHON -m pip}"
ALL="$DIR/all"
mkdir -p "$ALL" || usage_error "--dir $DIR: cannot create it"
SPECS=(megatron-core==0.16.1)
[ "$KERNELS" = 0 ] || mapfile -t -O 1 SPECS < <(grep -Ev '^\s*(#|$)' requirements-gpu-kernels.txt)
echo "gpu_wheels.sh: downloading ${#SPECS[@]} wheels for CPython 3.12, manylinux x86-64, into $ALL"
"${PIP[@]}" download --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any --pre -d "$ALL" "${SPECS[@]}" || { echo "gpu_wheels.sh: error: pip download failed" >&2; exit 1; }
# the parts: every wheel whole where it fits a part, else in pieces of a part's size; first fit, largest first
exec "$PYTHON" - "$ALL" "$DIR" "$PART_MIB" <<'PY'
import shutil, sys
from pathlib import Path

source, target, part = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) * 2**20
for old in target.glob("[0-9]*"):
    shutil.rmtree(old)
pieces = []  # (name, bytes)
for wheel in sorted(source.glob("*.whl")):
    data_size = wheel.stat().st_size
    if data_size <= part:
        pieces.append((wheel.name, wheel.read_bytes()))
        continue
    data = wheel.read_bytes()
    pieces += [(f"{wheel.name}.part-{i:02d}", data[at:at + part]) for i, at in enumerate(range(0, data_size, part))]
parts: list[list] = []
for name, data in sorted(pieces, key=lambda p: -len(p[1])):
    home = next((p for p in parts if sum(len(d) for _, d in p) + len(data) <= part), None)
    if home is None:
        parts.append(home := [])
    home.append((name, data))
for number, files in enumerate(parts, 1):
    folder = target / str(number)
    folder.mkdir(parents=True)
    for name, data in files:
        (folder / name).write_bytes(data)
    size = sum(len(d) for _, d in files) / 2**20
    print(f"  {folder}: {len(files)} files, {size:.1f} MiB")
print(f"gpu_wheels.sh: {len(pieces)} files in {len(parts)} parts; carry {', '.join(f'{target}/{n}' for n in range(1, len(parts) + 1))} "
      f"with one device call each, then 'bash scripts/setup_gpu.sh --wheels {target}' there")
PY
