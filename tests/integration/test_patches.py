"""Each CPU patch is needed (leave-one-out fails) and refuses an unexpected megatron-core version."""

from __future__ import annotations

import pytest

import patches
from patches._registry import PatchVersionError
from tests.launch import torchrun

TINY = ["pretrain_gpt.py", "--mock-data", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "2", "--train-iters", "1",
        "--pipeline-model-parallel-size", "2"]
SCENARIO_FLAGS = {"bf16_optimizer_type_check": ["--bf16"], "distributed_optimizer_type_check": ["--use-distributed-optimizer"],
                  "sequence_parallel_cpu": ["--pipeline-model-parallel-size", "1", "--tensor-model-parallel-size", "2",
                                            "--sequence-parallel", "--vocab-size", "64"],
                  "grad_scaler_cpu": ["--fp16"]}
NEEDS_CHECKPOINT = {"checkpoint_writer_cpu", "checkpoint_saver_cpu"}


def run_tiny(tmp_path, disabled: str = "", check: bool = True):
    flags = list(SCENARIO_FLAGS.get(disabled, []))

    if disabled in NEEDS_CHECKPOINT or not disabled:
        flags += ["--save", str(tmp_path / "ckpt")]
    return torchrun(2, *TINY, *flags, env={"EPP_DISABLE_PATCHES": disabled}, check=check, timeout=120)


def test_all_patches_train_and_checkpoint_on_cpu(tmp_path):
    proc = run_tiny(tmp_path)
    assert "iteration        1/       1" in proc.stdout
    assert "saved checkpoint at iteration 1" in proc.stdout


@pytest.mark.parametrize("name", [p.name for p in patches.CPU_PATCHES])
def test_training_fails_without_patch(tmp_path, name):
    proc = run_tiny(tmp_path, disabled=name, check=False)
    assert proc.returncode != 0, f"training still works without patch {name}: drop the patch"
    assert "CUDA" in proc.stderr or "cuda" in proc.stderr


@pytest.mark.parametrize("patch", patches.CPU_PATCHES, ids=lambda p: p.name)
def test_patch_refuses_other_megatron_core_version(monkeypatch, patch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.99.0")
    with pytest.raises(PatchVersionError, match="0.99.0"):
        patch.apply()


def test_every_patch_names_its_target_and_reason():
    for patch in patches.CPU_PATCHES:
        assert patch.target.startswith("megatron.core.") and len(patch.why) > 40, patch.name
