#!/usr/bin/env bash
# A throw-away SLURM cluster on this one host, for tests and trying the sbatch scripts:
#
#   bash scripts/slurm/local_cluster.sh start [N]   # munged + slurmctld + N slurmd (default 2 "nodes")
#   export SLURM_CONF=$EPP_SLURM_DIR/slurm.conf      # start prints this line; sbatch/srun/sinfo need it
#   bash scripts/slurm/local_cluster.sh stop        # cancel jobs, stop the daemons, remove all state
#   bash scripts/slurm/local_cluster.sh status
#
# Everything (config, munge key and socket, state, spool, logs, pid files) lives in EPP_SLURM_DIR
# (default /tmp/epp-slurm); ports are picked free at start, so clusters with different directories
# coexist and never touch a system SLURM/munge. Needs root and Debian's slurmctld, slurmd,
# slurm-client and munge (scripts/setup_env.sh installs them). N slurmd run with `-N` names
# (epp<id>n1..N) that /etc/hosts maps to 127.0.0.1 (lines tagged with the directory, removed at
# stop); each claims the host's CPUs and 90 % of its memory (`slurmd -C`). No cgroups:
# proctrack/linuxproc, task/none.
set -euo pipefail

DIR=${EPP_SLURM_DIR:-/tmp/epp-slurm}
DIR=$(mkdir -p "$DIR" && cd "$DIR" && pwd)
ID=$(printf %s "$DIR" | md5sum | cut -c1-6)
PREFIX="epp${ID}n"
TAG="# epp-local-slurm $DIR"
export SLURM_CONF="$DIR/slurm.conf"

die() { echo "local_cluster: $*" >&2; exit 1; }

pid_alive() {  # pid file $1 names a live process called $2 (a stale file's pid may be reused)
  [ -f "$1" ] && [ "$(cat "/proc/$(cat "$1")/comm" 2>/dev/null)" = "$2" ]
}

hosts_remove() {
  # Rewrite in place (/etc/hosts may be a bind mount: no rename).
  if grep -qF "$TAG" /etc/hosts 2>/dev/null; then
    local keep; keep=$(grep -vF "$TAG" /etc/hosts || true)
    printf '%s\n' "$keep" > /etc/hosts
  fi
}

stop() {
  if [ -f "$SLURM_CONF" ] && pid_alive "$DIR/slurmctld.pid" slurmctld; then
    scancel --full --quiet "--partition=epp" 2>/dev/null || true
    local i
    for i in $(seq 1 100); do   # up to 10 s (KillWait=5) for running jobs to be killed by their slurmd
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  local f pids=() name
  for f in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
    name=$(basename "$f" .pid); name=${name%%-*}
    if pid_alive "$f" "$name"; then pids+=("$(cat "$f")"); kill "$(cat "$f")" 2>/dev/null || true; fi
    if [ "$name" = slurmctld ] && [ ${#pids[@]} -gt 0 ]; then wait_gone "${pids[@]}"; fi  # slurm before munged
  done
  if [ ${#pids[@]} -gt 0 ]; then wait_gone "${pids[@]}"; fi
  # Job steps that outlived their slurmd: this cluster's slurmstepd (SLURM_CONF in its environment)
  # and their descendants.
  local strays=() p comm
  for p in /proc/[0-9]*; do
    comm=""; read -r comm < "$p/comm" 2>/dev/null || true
    [ "$comm" = slurmstepd ] || continue
    tr '\0' '\n' < "$p/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF" \
      && mapfile -t -O "${#strays[@]}" strays < <(tree "${p#/proc/}")
  done
  if [ ${#strays[@]} -gt 0 ]; then kill -9 "${strays[@]}" 2>/dev/null || true; fi
  hosts_remove
  rm -rf "$DIR"
}

tree() {  # a pid and its descendants
  local c
  echo "$1"
  for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do tree "$c"; done
}

wait_gone() {  # TERM, then KILL after 10 s
  local p
  for _ in $(seq 1 100); do
    local left=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && left=1; done
    [ $left = 0 ] && return 0
    sleep 0.1
  done
  for p in "$@"; do kill -9 "$p" 2>/dev/null || true; done
}

free_ports() {  # $1 distinct free TCP ports
  python3 - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

start() {
  local n=${1:-2}
  [[ $n =~ ^[1-9][0-9]*$ ]] || die "N must be a positive integer, got '$n'"
  [ "$(id -u)" = 0 ] || die "needs root (munged/slurmd run as system users)"
  local c
  for c in munged slurmctld slurmd sbatch scontrol; do
    command -v "$c" >/dev/null || [ -x "/usr/sbin/$c" ] || die "$c not found: apt-get install slurmctld slurmd slurm-client munge (or bash scripts/setup_env.sh)"
  done
  export PATH="$PATH:/usr/sbin"
  stop   # a clean slate: repeatable after a crash
  mkdir -p "$DIR"/{state,log,munge} && chmod 755 "$DIR"

  # munge: own key (0600, owned by munge) and socket; munged runs as the munge user.
  chown munge:munge "$DIR/munge" && chmod 755 "$DIR/munge"   # socket dir: x for all
  dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
  chown munge:munge "$DIR/munge/munge.key" && chmod 600 "$DIR/munge/munge.key"
  runuser -u munge -- munged --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --log-file="$DIR/munge/munged.log" --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/munged.seed" \
    || die "munged failed: $(tail -n 5 "$DIR/munge/munged.log" 2>/dev/null)"

  local host cpus mem ports i
  host=$(hostname -s)
  cpus=$(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' | head -n1)
  mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n1)
  mem=$(( mem * 9 / 10 ))
  read -r -a ports <<< "$(free_ports $((n + 1)))"

  cat > "$SLURM_CONF" <<CONF
ClusterName=epp$ID
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=${ports[0]}
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0
MinJobAge=5
EnforcePartLimits=ALL
KillWait=5
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
CONF
  local hosts=""
  for i in $(seq 1 "$n"); do
    echo "NodeName=$PREFIX$i NodeHostname=$host NodeAddr=127.0.0.1 Port=${ports[$i]} CPUs=$cpus RealMemory=$mem State=UNKNOWN" >> "$SLURM_CONF"
    hosts+=" $PREFIX$i"
  done
  echo "PartitionName=epp Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$SLURM_CONF"
  echo "127.0.0.1$hosts $TAG" >> /etc/hosts

  slurmctld -c || die "slurmctld failed: $(tail -n 5 "$DIR/log/slurmctld.log" 2>/dev/null)"
  for i in $(seq 1 "$n"); do
    slurmd -N "$PREFIX$i" || die "slurmd $PREFIX$i failed: $(tail -n 5 "$DIR/log/slurmd-$PREFIX$i.log" 2>/dev/null)"
  done
  for i in $(seq 1 300); do   # up to 30 s for every node to register idle
    [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = "$n" ] && break
    sleep 0.1
  done
  [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = "$n" ] \
    || die "nodes not idle after 30 s: $(sinfo -N 2>&1 | tail -n +2 | tr '\n' ';') (logs in $DIR/log)"
  echo "local_cluster: $n node(s) idle: $(sinfo -h -o %N)" >&2
  echo "export SLURM_CONF=$SLURM_CONF"
}

status() {
  [ -f "$SLURM_CONF" ] || { echo "no cluster in $DIR"; return 1; }
  sinfo -N && squeue
}

case "${1:-}" in
  start) start "${2:-${EPP_SLURM_NODES:-2}}" ;;
  stop) stop ;;
  status) status ;;
  *) die "usage: $0 start [N] | stop | status   (state in EPP_SLURM_DIR, default /tmp/epp-slurm)" ;;
esac
