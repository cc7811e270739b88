"""What the CUDA path decides before it runs, checked on CPU.

* ``--bf16`` casts the whole model (Float16Module, LayerNorms included: CUDA's layer_norm refuses
  bf16 input with fp32 weights, CPU's accepts it, so the cast is checked directly) and the elastic
  chunk context is still found through the wrappers;
* Transformer Engine counts as present only when ``transformer_engine.pytorch`` imports; fused
  softmax only when its kernels import; elastic mode always builds on the local spec and says so;
* one process per GPU is checked before any work;
* at pp=1 (one GPU) a tight budget still makes split and hybrid chunks;
* every cost profile names its device and source, and the planner's outputs print them.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import subprocess
import sys

import pytest
import torch

from megatron_epp.cost.profile import PROFILE_SOURCES, Profile
from megatron_epp.cost.profile_lookup import PROFILE_DIR, load_profile
from megatron_epp.cost.shape import MODEL_PRESETS
from tests.launch import REPO, run_env

TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "512",
        "--global-batch-size", "8"]


def elastic_args(*flags: str):
    from megatron_epp.config.parser import parse_config

    return parse_config([*TINY, "--elastic-pp", *flags], world_size=1).replace(model={"vocab_size": 257})


def cpu_runtime():
    from megatron_epp.base.dims import ParallelDims
    from megatron_epp.model.runtime import Runtime

    return Runtime(torch.device("cpu"), rank=0, pp_rank=0, tp_rank=0, dp_rank=0, dims=ParallelDims())


def test_bf16_casts_every_parameter_and_the_context_is_found_through_the_wrappers():
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import unwrap_model

    from megatron_epp.executor.context import ChunkContext
    from megatron_epp.measure.layer_bench import init_single_process
    from megatron_epp.model.gpt import build_model

    init_single_process()
    context = ChunkContext()
    model, config = build_model(elastic_args("--bf16", "--epp-memory-budget", "1"), cpu_runtime(), context=context)
    assert isinstance(model.module, Float16Module) and config.bf16
    dtypes = {name: p.dtype for name, p in unwrap_model(model).named_parameters()}
    assert any("layernorm" in name for name in dtypes) and set(dtypes.values()) == {torch.bfloat16}, dtypes
    assert ChunkContext.of(model) is context  # DDP -> Float16Module -> GPTModel
    fp32, _ = build_model(elastic_args("--epp-memory-budget", "1"), cpu_runtime(), context=ChunkContext())
    assert not isinstance(fp32.module, Float16Module)
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}


def probe_in_subprocess(tmp_path, code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=run_env({"PYTHONPATH": f"{tmp_path}:{REPO}"}))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_transformer_engine_is_probed_through_its_pytorch_layers(tmp_path):
    """A TE whose bare package imports but whose PyTorch extension does not (what TE's __init__ hides)."""
    (tmp_path / "transformer_engine" / "pytorch").mkdir(parents=True)
    (tmp_path / "transformer_engine" / "__init__.py").write_text("__version__ = '2.12.0'\n")
    (tmp_path / "transformer_engine" / "pytorch" / "__init__.py").write_text("raise ImportError('transformer_engine_torch: undefined symbol')\n")
    out = probe_in_subprocess(tmp_path, "import transformer_engine; from megatron_epp.executor.extensions import probe_transformer_engine; "
                                        "print(probe_transformer_engine())")
    assert out == "transformer_engine.pytorch does not import (ImportError: transformer_engine_torch: undefined symbol)"


def test_fused_softmax_only_where_its_kernel_imports(monkeypatch):
    from megatron_epp.model import gpt as model_module

    assert model_module.probe_fused_softmax().startswith("scaled_masked_softmax_cuda does not import")
    cuda = dataclasses.replace(cpu_runtime(), device=torch.device("cuda"))
    args = elastic_args("--epp-memory-budget", "1")
    monkeypatch.setattr(model_module.torch.cuda, "is_available", lambda: True)
    assert model_module.fused_softmax_unavailable().startswith("scaled_masked_softmax_cuda does not import")
    assert model_module.transformer_config(args, cuda).masked_softmax_fusion is False  # the first bf16 stock run died here
    monkeypatch.setattr(model_module, "probe_fused_softmax", lambda: None)
    assert model_module.transformer_config(args, cuda).masked_softmax_fusion is True
    assert model_module.transformer_config(args, cpu_runtime()).masked_softmax_fusion is False


def test_elastic_mode_builds_on_the_local_spec_and_says_so_when_te_is_present(monkeypatch):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_epp.model import gpt as model_module

    monkeypatch.setattr(model_module, "transformer_engine_available", lambda: True)
    assert model_module.elastic_base_layer_spec().submodules.self_attention.module is \
        get_gpt_layer_local_spec().submodules.self_attention.module
    line = model_module.layer_spec_summary(elastic=True)
    assert line.startswith("local spec + ElasticAttention") and "Transformer Engine imports but is not used with --elastic-pp" in line
    assert model_module.layer_spec_summary(elastic=False) == "Transformer Engine spec"


@pytest.mark.parametrize("local_world_size, gpus, ok", [(1, 1, True), (8, 8, True), (2, 1, False), (9, 8, False), (4, 0, True)])
def test_one_process_per_gpu(local_world_size, gpus, ok):
    from megatron_epp.model.runtime import gpu_oversubscription

    why = gpu_oversubscription(local_world_size, gpus)
    assert (why is None) == ok
    if not ok:
        assert "\n" not in why and f"{local_world_size} processes on this node but {gpus} GPU" in why


def test_more_ranks_than_gpus_stops_before_any_work(monkeypatch, capsys):
    from megatron_epp.training import main as main_module

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(main_module, "gpu_count", lambda: 1)
    monkeypatch.setattr(main_module, "initialize", lambda args: pytest.fail("initialize reached"))
    from megatron_epp.config.parser import parse_config

    assert main_module.main(parse_config([*TINY], world_size=1)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pretrain_gpt.py: error: 2 processes on this node but 1 GPU: one process per GPU "
                   "(torchrun --nproc-per-node 1, or CUDA_VISIBLE_DEVICES)"]


def test_one_stage_under_a_tight_budget_still_splits_and_packs():
    """pp=1 (one GPU): Seq1F1B's plan for a tight budget has split and hybrid chunks (the whole elastic path on one
    GPU); the elastic builder fits the same budget by recompute without slicing (on one stage every slice of a
    sequence is live until its backward: slicing saves no memory beyond the recompute transient, and costs time)."""
    from megatron_epp.training.planning import online_planner

    lengths = [512, 400, 60, 30, 20, 10, 200, 5]
    seq1f1b = ("--epp-plan", "seq1f1b", "--epp-max-slices", "4")
    tight = online_planner(elastic_args("--pipeline-model-parallel-size", "1", *seq1f1b, "--epp-memory-budget", "0.003"))(lengths).plan
    assert tight.num_stages == 1 and tight.chunk_counts()["split"] > 0 and tight.chunk_counts()["hybrid"] > 0
    assert tight.recomputed_layers() > 0
    elastic = online_planner(elastic_args("--pipeline-model-parallel-size", "1", "--epp-memory-budget", "0.003"))(lengths)
    assert elastic.report.fits and elastic.plan.recomputed_layers() > 0
    assert elastic.report.predicted_step_ms <= elastic.report.candidates_ms["seq1f1b-k4"]
    loose = online_planner(elastic_args("--pipeline-model-parallel-size", "1", "--epp-memory-budget", "1"))(lengths).plan
    assert loose.chunk_counts()["split"] == 0


def test_every_profile_names_its_device_and_source(tmp_path):
    shipped = sorted(PROFILE_DIR.glob("*.json"))
    assert shipped
    for path in shipped:
        raw = json.loads(path.read_text())
        assert raw["device"] and raw["source"] in PROFILE_SOURCES, path
    for name in MODEL_PRESETS:
        profile = load_profile(name)
        assert profile.source == "analytic" and "H100" in profile.device
    raw = json.loads((PROFILE_DIR / "test-model_cpu.json").read_text())
    for missing in ("device", "source"):
        broken = tmp_path / f"no-{missing}.json"
        broken.write_text(json.dumps({k: v for k, v in raw.items() if k != missing}))
        with pytest.raises(ValueError, match=f"no-{missing}.json: profile has no '{missing}'"):
            Profile.load(broken)
    (tmp_path / "guessed.json").write_text(json.dumps({**raw, "source": "guessed"}))
    with pytest.raises(ValueError, match="profile source 'guessed': expected measured or analytic"):
        Profile.load(tmp_path / "guessed.json")


def test_epp_plan_prints_where_its_profile_comes_from(tmp_path, capsys):
    from megatron_epp.planner.cli import main

    lengths = tmp_path / "lengths.txt.gz"
    with gzip.open(lengths, "wt") as f:
        f.write("\n".join(map(str, [3000, 800, 200, 50] * 4)) + "\n")
    for spec, source, device in (("test-model", "measured", "CPU"), ("llama-7b", "analytic", "H100")):
        main([str(lengths), "--epp-profile", spec, "--stages", "2", "--max-seq-len", "4096", "--baselines", "", "--epp-memory-budget", "40"])
        first = capsys.readouterr().out.splitlines()[0]
        assert f"({source} profile, {device}" in first, first
