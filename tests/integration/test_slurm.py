"""scripts/slurm/train.sbatch on a one-host SLURM cluster (scripts/slurm/local_cluster.sh).

Single node (1 x torchrun with 2 ranks), two nodes (2 x torchrun with 2 ranks each, pp=2 across the
"nodes", --context-parallel-size 2 inside each), a failing training that must fail `sbatch --wait`, and a job stopped by `scancel --signal=TERM`
that saves, exits 0 and is resumed by a second job. Each job's log must show every
iteration with a loss: a job that never trained can still exit 0. Without SLURM installed the tests
skip, except under CI=true, where they fail (bash scripts/setup_env.sh installs it as root).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_epp.training.metrics import read_metrics
from tests.launch import free_port, logged_losses
from tests.paths import REPO

SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
CLUSTER = REPO / "scripts" / "slurm" / "local_cluster.sh"
ITERS = 4
TINY = ["--elastic-pp", "--mock-data", "--pipeline-model-parallel-size", "2", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "256",
        "--global-batch-size", "8", "--train-iters", str(ITERS), "--log-interval", "1"]


def _unavailable() -> str | None:
    missing = [c for c in ("sbatch", "srun", "scontrol", "slurmctld", "slurmd", "munged")
               if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} not found); as root, "
                "bash scripts/setup_env.sh installs slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        return "the one-host SLURM cluster needs root (munged and slurmd run as system users)"
    return None


@pytest.fixture(scope="module")
def cluster():
    reason = _unavailable()
    if reason:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true, and the SLURM tests cannot run: {reason}")
        pytest.skip(reason)
    state = tempfile.mkdtemp(prefix="epp-slurm-", dir="/tmp")   # not under pytest's 0700 tmp: munge must traverse it
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # e.g. pytest run inside a job
    env.update(EPP_SLURM_DIR=state, SLURM_CONF=f"{state}/slurm.conf", PATH=f"{env.get('PATH', '')}:/usr/sbin",
               PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    try:
        start = subprocess.run(["bash", str(CLUSTER), "start", "2"], env=env, capture_output=True, text=True, timeout=120)
        assert start.returncode == 0, f"local_cluster.sh start failed:\n{start.stdout}\n{start.stderr}"
        yield env
    finally:
        stop = subprocess.run(["bash", str(CLUSTER), "stop"], env=env, capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, f"local_cluster.sh stop failed:\n{stop.stdout}\n{stop.stderr}"
        assert not Path(state).exists()


def sbatch(env: dict, out: Path, *args: str, nodes: int, cwd: Path = REPO, **extra: str) -> tuple[int, str]:
    """``sbatch --wait -N nodes train.sbatch args`` from ``cwd``: (exit status, job log)."""
    cmd = ["sbatch", "--wait", f"--nodes={nodes}", f"--output={out}", str(SBATCH), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=dict(env, MASTER_PORT=str(free_port()), **extra),
                          capture_output=True, text=True, timeout=600)
    log = out.read_text() if out.exists() else ""
    return proc.returncode, f"{proc.stdout}{proc.stderr}\n--- job log ---\n{log}"


def assert_trained(rc: int, log: str, nodes: int, layout: str) -> None:
    assert rc == 0, log[-6000:]
    assert f"on {nodes} node(s)" in log, log[-6000:]
    assert layout in log, log[-6000:]
    losses = logged_losses(log)
    assert sorted(losses) == list(range(1, ITERS + 1)), log[-6000:]
    assert all(math.isfinite(float(v)) for v in losses.values()), losses


def test_single_node(cluster, tmp_path):
    # Submitted from a subdirectory: the script finds the repository upwards from $SLURM_SUBMIT_DIR.
    rc, log = sbatch(cluster, tmp_path / "job.out", *TINY, nodes=1, cwd=REPO / "tests")
    assert_trained(rc, log, 1, "tp=1 pp=2 dp=1")


def test_two_nodes_pipeline_across_nodes_context_parallel_inside(cluster, tmp_path):
    """2 nodes x 2 ranks, pp 2 x cp 2 (InfiniPipe's layout: Ulysses context parallelism inside a node, the elastic
    pipeline across nodes; megatron-core's rank order puts a stage's CP group on one node). CP in effect: the layout
    line says cp=2, every step's log line has each stage's and CP rank's measured activation peak, and each of the
    four equals the planner's prediction for a CP rank of its stage to the byte (calibration off), in bf16 with
    learned positions (the first stage's position ids, each CP rank's own) and one K/V head (replicated over CP)."""
    metrics = tmp_path / "metrics.jsonl"
    rc, log = sbatch(cluster, tmp_path / "job.out", *TINY, "--context-parallel-size", "2", "--epp-calibrate-interval", "0",
                     "--bf16", "--position-embedding-type", "learned_absolute", "--group-query-attention",
                     "--num-query-groups", "1", "--epp-metrics", str(metrics), nodes=2, NPROC_PER_NODE="2")
    assert_trained(rc, log, 2, "tp=1 cp=2 pp=2 dp=1")
    records = read_metrics(metrics)
    assert [m.iteration for m in records] == list(range(1, ITERS + 1))
    for m in records:
        e = m.elastic
        assert e.memory_factor == 1.0 and len(e.measured_cp_activation_bytes) == 2, e
        assert all(len(ranks) == 2 and all(meas == pred for meas in ranks)
                   for pred, ranks in zip(e.predicted_activation_bytes, e.measured_cp_activation_bytes, strict=True)), e
        assert "act MB meas per stage and CP rank: " in m.line() and m.line() in log


def test_failing_training_fails_the_job(cluster, tmp_path):
    rc, log = sbatch(cluster, tmp_path / "job.out", *TINY, "--no-such-flag", nodes=1, NPROC_PER_NODE="1")
    assert rc != 0, log[-6000:]
    assert "unrecognized arguments: --no-such-flag" in log, log[-6000:]


def test_scancel_saves_and_the_job_resumes(cluster, tmp_path):
    """`scancel --signal=TERM` of a running job (what `#SBATCH --signal=TERM@120` does before the time
    limit): the ranks finish the step, save (train.sbatch adds --exit-signal-handler to a run with
    --save) and the job exits 0; a second job with --load continues from that checkpoint."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    run = [*TINY, "--train-iters", "40", "--save", str(ckpt)]
    cmd = ["sbatch", "--wait", "--parsable", "--nodes=1", f"--output={log}", str(SBATCH), *run]
    job = subprocess.Popen(cmd, cwd=REPO, env=dict(cluster, MASTER_PORT=str(free_port())), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    job_id = job.stdout.readline().strip().split(";")[0]
    deadline = time.monotonic() + 300
    while not (log.exists() and "iteration        3/" in log.read_text()):
        assert job.poll() is None and time.monotonic() < deadline, (log.read_text() if log.exists() else "no log")[-4000:]
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=TERM", job_id], env=cluster, check=True, timeout=30)
    assert job.wait(timeout=300) == 0, log.read_text()[-6000:]
    text = log.read_text()
    stopped = int(re.search(r"exiting after iteration (\d+): SIGTERM received", text).group(1))
    assert 3 <= stopped < 40 and max(logged_losses(text)) == stopped, text[-6000:]
    assert f"saved checkpoint at iteration {stopped} to" in text
    # the second job trains two steps (--exit-interval) rather than the 40 - stopped left: that it resumes is the point
    rc, resumed = sbatch(cluster, tmp_path / "resumed.out", *run, "--load", str(ckpt), "--exit-interval", str(stopped + 2),
                         nodes=1)
    assert rc == 0 and f"resumed at iteration {stopped}" in resumed, resumed[-6000:]
    assert sorted(logged_losses(resumed)) == [stopped + 1, stopped + 2], resumed[-6000:]
    assert f"saved checkpoint at iteration {stopped + 2} to" in resumed, resumed[-6000:]
