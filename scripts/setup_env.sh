#!/usr/bin/env bash
# Install the pinned CPU environment (torch 2.13.0 CPU wheel, megatron-core 0.16.1, ...). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --disable-pip-version-check -q -r requirements.txt

# jemalloc for the training processes (megatron_epp/training/host_allocator.py; optional): Debian's
# libjemalloc2, installed only when missing, as root, where apt-get exists; a failed install is a warning.
if ! ldconfig -p 2>/dev/null | grep -q 'libjemalloc\.so' && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup_env: installing libjemalloc2 (apt-get)" >&2
  install_jemalloc() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends -o Dpkg::Use-Pty=0 libjemalloc2 >/dev/null 2>&1; }
  install_jemalloc || { apt-get update -q >/dev/null 2>&1 && install_jemalloc; } \
    || echo "setup_env: warning: libjemalloc2 did not install; training runs on the system allocator" >&2
fi

# SLURM for tests/integration/test_slurm.py (a one-host cluster, scripts/slurm/local_cluster.sh): Debian's
# slurmctld, slurmd, slurm-client and munge, installed only when missing, as root, where apt-get
# exists. EPP_NO_SLURM_INSTALL=1 leaves it out. Daemons are not started by the install (policy-rc.d).
slurm_missing() {
  local c
  for c in sbatch slurmctld slurmd munged; do
    command -v "$c" >/dev/null 2>&1 || [ -x "/usr/sbin/$c" ] || return 0
  done
  return 1
}
if slurm_missing && [ "${EPP_NO_SLURM_INSTALL:-0}" != 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup_env: installing slurmctld slurmd slurm-client munge (apt-get)" >&2
  pkgs=(slurmctld slurmd slurm-client munge)
  log=$(mktemp) policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then                 # keep the packages from starting daemons
    policy=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
  fi
  trap 'rm -f "$log" ${policy:+"$policy"}' EXIT
  if ! { apt-cache show "${pkgs[@]}" >/dev/null 2>&1 || apt-get update -q; } >"$log" 2>&1 \
     || ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends -o Dpkg::Use-Pty=0 \
          "${pkgs[@]}" >>"$log" 2>&1; then
    cat "$log" >&2; echo "setup_env: installing SLURM failed" >&2; exit 1
  fi
fi
