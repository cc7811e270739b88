"""scripts/setup_gpu.sh on CPU, with a fake pip (``PIP``) and fake broken packages on PYTHONPATH.

The fake pip installs the runtime requirements as a no-op; "installs" Transformer Engine as a package
whose PyTorch extension fails to load (as a TE built against another torch does) and flash-attn as
a failed build that leaves a broken package behind; ``uninstall`` removes what it installed. The
script must warn about both, remove them, exit 0, and the library must then report its fallbacks:
the local layer spec and SDPA attention. A broken flash-attn that pip cannot remove (elsewhere on
PYTHONPATH) must also leave the library on SDPA. Bad options and a torch that does not import are
one-line errors.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import textwrap
from pathlib import Path

from tests.launch import REPO, run_env

FAKE_PIP = textwrap.dedent("""\
    #!/usr/bin/env bash
    # fake pip: logs its arguments; installs broken optional packages into $FAKE_SITE
    echo "$*" >> "$FAKE_SITE/../pip.calls"
    case "$1" in
      uninstall)
        for name in "$@"; do
          case "$name" in
            transformer-engine) rm -rf "$FAKE_SITE/transformer_engine" ;;
            flash-attn) rm -rf "$FAKE_SITE/flash_attn" ;;
          esac
        done
        exit 0 ;;
    esac
    case "$*" in
      *--no-deps*flash-attn-4==*)  # the kernels: "installed", but flash_attn.cute cannot load its CUDA libraries
        [ -z "${CHANGE_TRITON:-}" ] || { mkdir -p "$FAKE_SITE/triton-9.9.9.dist-info"; printf 'Metadata-Version: 2.1\nName: triton\nVersion: 9.9.9\n' > "$FAKE_SITE/triton-9.9.9.dist-info/METADATA"; }
        echo "Successfully installed flash-attn-4-4.0.0b36"; exit 0 ;;
      *requirements-gpu.txt*) [ -z "${FAIL_REQUIREMENTS:-}" ] || { echo "ERROR: No matching distribution found for megatron-core==0.16.1"; exit 1; }; exit 0 ;;
      *transformer-engine*)
        mkdir -p "$FAKE_SITE/transformer_engine/pytorch"
        echo '__version__ = "2.12.0"' > "$FAKE_SITE/transformer_engine/__init__.py"
        echo 'raise ImportError("transformer_engine_torch: undefined symbol _ZN3c104cuda")' > "$FAKE_SITE/transformer_engine/pytorch/__init__.py"
        echo "Successfully installed transformer-engine-2.12.0"; exit 0 ;;
      *flash-attn*)
        mkdir -p "$FAKE_SITE/flash_attn"
        echo 'raise ImportError("flash_attn_2_cuda: cannot open shared object file")' > "$FAKE_SITE/flash_attn/__init__.py"
        echo "error: subprocess-exited-with-error"; echo "ERROR: Failed building wheel for flash-attn"; exit 1 ;;
    esac
    exit 0
    """)


def setup(tmp_path: Path, *options: str, extra_path: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    pip = tmp_path / "pip"
    pip.write_text(FAKE_PIP)
    pip.chmod(0o755)
    paths = [str(site)] + ([str(extra_path)] if extra_path else []) + [str(REPO)]
    full_env = run_env({"PIP": str(pip), "FAKE_SITE": str(site), "PYTHONPATH": os.pathsep.join(paths), **(env or {})})
    return subprocess.run(["bash", "scripts/setup_gpu.sh", "--log-dir", str(tmp_path / "logs"), *options], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=300)


def pip_calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "pip.calls").read_text().splitlines()


def test_failed_optional_kernels_warn_and_the_library_falls_back_to_sdpa(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    proc = setup(tmp_path, "--find-links", str(wheels))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    te = [w for w in warnings if "transformer-engine not available" in w]
    flash = [w for w in warnings if "flash-attn not available" in w]
    assert len(te) == 1 and "installed but transformer_engine.pytorch does not import" in te[0] and "undefined symbol" in te[0]
    assert len(flash) == 1 and "pip failed (exit 1)" in flash[0] and "Failed building wheel for flash-attn" in flash[0]
    # both removed again: a TE without its PyTorch extension breaks megatron-core's own imports
    assert not (tmp_path / "site" / "transformer_engine").exists() and not (tmp_path / "site" / "flash_attn").exists()
    calls = pip_calls(tmp_path)
    installs = [c for c in calls if c.startswith("install")]
    assert len(installs) == 4 and all(f"--no-index --find-links {wheels}" in c for c in installs)
    assert "-r requirements-gpu.txt" in installs[0]
    assert "--no-build-isolation" in installs[1] and "transformer-engine[pytorch]==2.12.0" in installs[1]
    assert "--no-build-isolation" in installs[2] and "flash-attn>=2.8.3.post2" in installs[2]
    assert any(c.startswith("uninstall -y transformer-engine") for c in calls) and "uninstall -y flash-attn" in calls
    # what the library reports afterwards, by its own probes
    assert "  stock path: local spec" in proc.stdout
    assert "> elastic attention: sdpa-merged (EPP_ATTENTION_BACKEND=auto, cpu float32; no flash: flash-attn does not import" in proc.stdout


def test_a_broken_flash_attn_that_stays_leaves_the_library_on_sdpa(tmp_path):
    stuck = tmp_path / "elsewhere"
    (stuck / "flash_attn").mkdir(parents=True)
    (stuck / "flash_attn" / "__init__.py").write_text('raise ImportError("flash_attn_2_cuda: undefined symbol _ZN2at4_ops")\n')
    proc = setup(tmp_path, "--no-te", extra_path=stuck)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "transformer-engine: skipped (--no-te)" in proc.stdout
    assert not any("transformer-engine" in c for c in pip_calls(tmp_path) if c.startswith("install"))
    assert "no flash: flash-attn does not import (ImportError: flash_attn_2_cuda: undefined symbol _ZN2at4_ops)" in proc.stdout


def test_runtime_install_failure_and_bad_options_are_errors(tmp_path):
    failed = setup(tmp_path, env={"FAIL_REQUIREMENTS": "1"})
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines()[-1].startswith("setup_gpu.sh: error: requirements-gpu.txt did not install")
    for options, message in ((["--find-links", str(tmp_path / "none")], "--find-links"), (["--bogus"], "unknown option --bogus"),
                             (["--build-timeout", "soon"], "--build-timeout soon: expected whole seconds")):
        proc = setup(tmp_path, *options)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr, proc.stderr


def test_torch_that_does_not_import_is_one_clear_error(tmp_path):
    fake = tmp_path / "fake-torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("libcudart.so.13: cannot open shared object file")\n')
    proc = setup(tmp_path, extra_path=None, env={"PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO)])})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch does not import (ImportError: libcudart.so.13" in lines[0] and "driver >= 580" in lines[0]
    assert not (tmp_path / "pip.calls").exists()  # nothing installed


KERNEL_SPECS = [line for line in (REPO / "requirements-gpu-kernels.txt").read_text().splitlines() if line and not line.startswith("#")]


def installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_kernels_install_without_deps_and_are_removed_where_flash_attn_4_does_not_import(tmp_path):
    """requirements-gpu-kernels.txt goes in with --no-deps (torch's triton and CUDA libraries untouched), only what is
    missing; where flash_attn.cute does not import afterwards it is a warning, what was installed is uninstalled, and
    the attention falls back. A triton changed by the install is an error."""
    proc = setup(tmp_path, "--no-te", "--no-flash")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    installs = [c for c in pip_calls(tmp_path) if c.startswith("install") and "--no-deps" in c]
    missing = [spec for spec in KERNEL_SPECS if not installed(spec.split("==")[0])]
    assert missing and len(installs) == 1 and installs[0].split()[-len(missing):] == missing  # what this machine lacks
    warning = [line for line in proc.stderr.splitlines() if "kernels not available" in line]
    assert len(warning) == 1 and "flash_attn.cute does not import" in warning[0], proc.stderr
    uninstall = [c for c in pip_calls(tmp_path) if c.startswith("uninstall")]
    assert len(uninstall) == 1 and "flash-attn-4" in uninstall[0].split() and "quack-kernels" in uninstall[0].split()
    assert "kernels (flash-attn-4, liger-kernel, quack-kernels): not available" in proc.stdout
    assert "kernels: skipped (--no-kernels)" in setup(tmp_path, "--no-te", "--no-flash", "--no-kernels").stdout
    (tmp_path / "t").mkdir()
    changed = setup(tmp_path / "t", "--no-te", "--no-flash", env={"CHANGE_TRITON": "1"})
    assert changed.returncode == 1 and "error: triton changed from" in changed.stderr.strip().splitlines()[-1] and "9.9.9" in changed.stderr


def test_wheels_joins_the_pieces_of_its_parts(tmp_path):
    """``--wheels DIR``: the wheels of DIR and of its parts DIR/1, DIR/2 (scripts/gpu_wheels.sh's layout) in one folder,
    a wheel cut into pieces across parts joined back byte for byte, and pip pointed there alone."""
    wheels = tmp_path / "whl"
    data = bytes(range(256)) * 1000
    for part, files in {"1": {"big-1.0-py3-none-any.whl.part-00": data[:100_000], "a-1.0-py3-none-any.whl": b"a"},
                        "2": {"big-1.0-py3-none-any.whl.part-01": data[100_000:]}}.items():
        (wheels / part).mkdir(parents=True)
        for name, content in files.items():
            (wheels / part / name).write_bytes(content)
    proc = setup(tmp_path, "--wheels", str(wheels), "--no-te", "--no-flash", "--no-kernels")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    joined = tmp_path / "logs" / "wheels"
    assert (joined / "big-1.0-py3-none-any.whl").read_bytes() == data and (joined / "a-1.0-py3-none-any.whl").read_bytes() == b"a"
    assert "big-1.0-py3-none-any.whl joined from 2 pieces" in proc.stdout
    assert all(f"--no-index --find-links {joined}" in c for c in pip_calls(tmp_path) if c.startswith("install"))
