"""FlashAttention 4 (``flash-attn-4``, CuTe DSL, Hopper/Blackwell) as the elastic attention's ``fa4-varlen`` kernel, on CPU.

CI has no GPU and no flash-attn-4, so its ``flash_attn_varlen_func`` is replaced by a reference of its documented
semantics (``benchmarks/attention_harness.reference_fa4_varlen_func``: plain torch, separate ``cu_seqlens_q`` /
``cu_seqlens_k``, causal bottom-right, GQA without expanded K/V, ``(out, lse)`` returned) on CPU float32, through the
real path's packing and index building. Pinned here: outputs and gradients equal the SDPA path on random batched, split
and hybrid plans (MHA, GQA, MQA); a kernel aligned top-left breaks that match and fails the start-up probe, which
then leaves it unchosen; the decision (present, absent, failing its probe, raising in it, the wrong device or GPU
generation, dropout, forced with ``EPP_ATTENTION_BACKEND=fa4``) and its start-up line; one probe per head shape; the
compile cache's configuration; and the profile key naming the kernel. What this does not check: the real kernels
(``benchmarks/check_cuda_attention.py`` and ``scripts/gpu_check.sh`` on a GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.attention_harness import make_attention, random_tensors, reference_fa4_varlen_func, reference_varlen, run_plan, worst_errors
from megatron_epp.cost.profile_lookup import ProfileKey, kernel_cache_dir
from megatron_epp.cost.shape import MODEL_PRESETS
from megatron_epp.executor import fa4, kernels
from megatron_epp.executor.kernels import AttentionBackendError
from tests.workers.random_plans import random_lengths, random_plan

TOL = 1e-5  # float32, the same maths in another order
CPU = torch.device("cpu")
HEADS = [(4, 4), (4, 2), (6, 1)]  # MHA, GQA, MQA
REFERENCE = fa4.CuteFlashKernel(reference_fa4_varlen_func, "4.0.0b36 (reference)", devices=("cpu",), dtypes=(torch.float32,), architectures=None)


def top_left_fa4(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
                 causal=False, **unused):
    """A flash-attn-4 whose causal mask is aligned top-left (flash-attn before 2.1): a slice's queries then miss
    the last ``C`` of the keys they should see."""
    outputs = []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        sq = cq[i + 1] - cq[i]
        cut = ck[i] + sq  # the first sq keys only: top-left causal over them
        seqlens = (torch.tensor([0, sq], dtype=torch.int32), torch.tensor([0, sq], dtype=torch.int32))
        outputs.append(reference_varlen(q[cq[i]:cq[i + 1]], k[ck[i]:cut], v[ck[i]:cut], *seqlens, sq, sq, softmax_scale, causal))
    return torch.cat(outputs), None


TOP_LEFT = fa4.CuteFlashKernel(top_left_fa4, "top-left", devices=("cpu",), dtypes=(torch.float32,), architectures=None)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)
    kernels.reset_flash_probe()
    monkeypatch.setattr(kernels, "load_torch_varlen", lambda: (None, "torch's varlen_attn not in this test"))
    monkeypatch.setattr(kernels, "load_flash_kernel", lambda: (None, "flash-attn does not import (test)"))
    yield
    kernels.reset_flash_probe()


def use_fa4(monkeypatch, kernel: fa4.CuteFlashKernel | None, why: str = "flash-attn-4 does not import (test)") -> None:
    monkeypatch.setattr(fa4, "load_kernel", lambda: (kernel, "" if kernel else why))


def plans(cases: int):
    for case in range(cases):
        lengths = random_lengths(np.random.default_rng([5, case]))
        yield case, random_plan(np.random.default_rng([5, case, 1]), lengths, 1, 1)


def run(monkeypatch, request: str, plan, heads: int, kv_heads: int, seed: int):
    monkeypatch.setenv(kernels.ENV, request)
    attention = make_attention(heads, kv_heads, 8)
    return run_plan(attention, plan, random_tensors(plan, heads, kv_heads, 8, torch.float32, "cpu", seed), "cpu")


@pytest.mark.parametrize("heads, kv_heads", HEADS, ids=["mha", "gqa", "mqa"])
def test_fa4_varlen_matches_sdpa(monkeypatch, capsys, heads, kv_heads):
    use_fa4(monkeypatch, REFERENCE)
    for case, plan in plans(6):
        errors = worst_errors(run(monkeypatch, "fa4", plan, heads, kv_heads, case), run(monkeypatch, "sdpa", plan, heads, kv_heads, case))
        assert max(errors.values()) < TOL, f"case {case}: {errors}"
    line = next(line for line in capsys.readouterr().out.splitlines() if "fa4-varlen" in line)
    assert line.startswith("> elastic attention: fa4-varlen (EPP_ATTENTION_BACKEND=fa4, cpu float32; flash-attn-4 4.0.0b36 (reference), "
                           "compiled and probed in "), line


def test_top_left_kernel_breaks_the_match_and_fails_its_probe(monkeypatch, capsys):
    """The planted fault (causal aligned top-left) is seen by the contract on plans with a slice over its prefix, and
    by the start-up probe, which leaves the kernel unchosen under ``auto`` (the next kernel runs) and fails ``fa4``."""
    use_fa4(monkeypatch, TOP_LEFT)
    broken_cases = 0
    for case, plan in plans(4):
        sdpa = run(monkeypatch, "sdpa", plan, 4, 2, case)
        with monkeypatch.context() as forced:  # the kernel as it is, unprobed
            forced.setattr(kernels, "select_backend", lambda *a, **k: "fa4-varlen")
            broken = run(monkeypatch, "auto", plan, 4, 2, case)
        if any(c.kind != "batched" for p in plan.pipelines for c in p.chunks):
            assert max(worst_errors(broken, sdpa).values()) > 1e-2, case
            broken_cases += 1
    assert broken_cases >= 2
    result = fa4.probe(TOP_LEFT, CPU, torch.float32, 4, 2, 8)
    assert result.why.startswith("its probe is off: worst error ") and result.error > 1e-2
    choice, reason = kernels.decide("auto", CPU, torch.float32, 0.0, True, (None, "x"), (None, "y"),
                                    kernels.fa4_state("auto", CPU, torch.float32, 0.0, (4, 2, 8)))
    assert choice == "sdpa-merged"
    with pytest.raises(AttentionBackendError, match=r"^EPP_ATTENTION_BACKEND=fa4 but flash-attn-4 cannot run: flash-attn-4 top-left: its probe is off"):
        kernels.select_backend("fa4", CPU, torch.float32, heads=(4, 2, 8))


def test_decision(monkeypatch, capsys):
    """``auto`` takes flash-attn-4 first where it imports, takes the tensors and passes its probe; otherwise the kernels
    before it decide as they did, the CUDA line saying why not flash-attn-4 (CPU lines say nothing of it)."""
    cuda = torch.device("cuda")
    use_fa4(monkeypatch, REFERENCE)
    assert kernels.select_backend("auto", CPU, torch.float32, heads=(4, 2, 8)) == "fa4-varlen"
    assert kernels.select_backend("auto", CPU, torch.float32, heads=None) == "sdpa-merged"  # nothing to probe: not chosen
    assert kernels.select_backend("auto", CPU, torch.float32, dropout=0.1, heads=(4, 2, 8)) == "sdpa-masked"
    assert kernels.select_backend("sdpa", CPU, torch.float32, heads=(4, 2, 8)) == "sdpa-merged"
    assert kernels.select_backend("auto", CPU, torch.bfloat16, heads=(4, 2, 8)) == "sdpa-merged"
    use_fa4(monkeypatch, None)
    assert kernels.select_backend("auto", CPU, torch.float32, heads=(4, 2, 8)) == "sdpa-merged"
    assert kernels.select_backend("auto", cuda, torch.bfloat16, heads=(4, 2, 8)) == "sdpa-causal"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("> elastic attention: fa4-varlen (EPP_ATTENTION_BACKEND=auto, cpu float32; flash-attn-4 4.0.0b36 (reference), "
                               "one call per chunk, compiled and probed in ")
    assert not any("fa4" in line for line in lines[1:6]), lines
    assert lines[6].startswith("> elastic attention: sdpa-causal (EPP_ATTENTION_BACKEND=auto, cuda bfloat16; no fa4: flash-attn-4 does not "
                               "import (test); no flash: flash-attn does not import (test); "), lines[6]
    with pytest.raises(AttentionBackendError, match=r"^EPP_ATTENTION_BACKEND=fa4 but flash-attn-4 does not import \(test\); install it"):
        kernels.check_request("fa4")


def test_wrong_device_and_generation(monkeypatch):
    """The real kernel's limits: CUDA tensors of 16 bits on sm90 or sm100; an A100 (8.0) or an sm120 card is refused,
    with the reason, before any probe runs."""
    kernel = fa4.CuteFlashKernel(reference_fa4_varlen_func, "4.0.0b36")
    assert kernel.unsupported(CPU, torch.bfloat16) == "tensors on cpu, flash-attn-4 runs on cuda"
    cuda = torch.device("cuda")
    assert kernel.unsupported(cuda, torch.float32) == "dtype float32, flash-attn-4 takes float16/bfloat16"
    assert kernel.unsupported(cuda, torch.bfloat16, 0.1) == "attention dropout 0.1, which flash-attn-4 has not"
    for capability, refused in (((8, 0), True), ((9, 0), False), ((10, 0), False), ((12, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        why = kernel.unsupported(cuda, torch.bfloat16)
        assert (why is not None) == refused and (not refused or why.startswith(f"GPU compute capability {capability[0]}.0: ")), (capability, why)
    use_fa4(monkeypatch, kernel)
    probed = []
    monkeypatch.setattr(fa4, "probe", lambda *a, **k: probed.append(a))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert kernels.fa4_state("auto", cuda, torch.bfloat16, 0.0, (4, 2, 8))[0] is None and probed == []


def test_probe_runs_once_per_head_shape_and_a_raising_kernel_is_not_chosen(monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return reference_fa4_varlen_func(*args, **kwargs)

    kernel = fa4.CuteFlashKernel(counting, "counting", devices=("cpu",), dtypes=(torch.float32,), architectures=None)
    for _ in range(3):
        assert fa4.probe(kernel, CPU, torch.float32, 4, 2, 8).why == ""
    fa4.probe(kernel, CPU, torch.float32, 8, 2, 16)
    assert len(calls) == 2  # one forward per head shape (the backward is the reference's autograd)

    def raising(*args, **kwargs):
        raise RuntimeError("DSLRuntimeError: cannot compile for this architecture\nmore")

    use_fa4(monkeypatch, fa4.CuteFlashKernel(raising, "raising", devices=("cpu",), dtypes=(torch.float32,), architectures=None))
    kernel_or_none, why = kernels.fa4_state("auto", CPU, torch.float32, 0.0, (4, 2, 8))
    assert kernel_or_none is None and why == ("flash-attn-4 raising: its probe failed (RuntimeError: DSLRuntimeError: cannot compile "
                                              "for this architecture)")


def test_compile_cache_configuration(monkeypatch, tmp_path):
    """The cache is turned on in the run's cache directory unless the environment already says how, and only before
    the package is imported (it reads the variables once); the start-up words say which."""
    for name in (fa4.CACHE_ENABLED, fa4.CACHE_DIR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(__import__("sys").modules, fa4.MODULE, raising=False)
    directory = kernel_cache_dir(str(tmp_path))
    assert directory == tmp_path / "kernels" / "flash-attn-4"
    assert fa4.configure_compile_cache(directory) == f"compile cache {directory}"
    assert __import__("os").environ[fa4.CACHE_ENABLED] == "1" and __import__("os").environ[fa4.CACHE_DIR] == str(directory)
    monkeypatch.setenv(fa4.CACHE_ENABLED, "0")
    assert fa4.configure_compile_cache(directory) == f"compile cache off ({fa4.CACHE_ENABLED}=0 set)"
    monkeypatch.setitem(__import__("sys").modules, fa4.MODULE, object())
    assert fa4.configure_compile_cache(directory).startswith("compile cache as flash_attn.cute found it at its import")


def test_profile_key_names_the_kernel():
    """A profile measured with torch-varlen is not the one of a run on flash-attn-4: the kernel is in the key."""
    shape = MODEL_PRESETS["llama-7b"]
    keys = {kernel: ProfileKey.of("NVIDIA H200", "bfloat16", kernel, shape, "2.11.0+cu130", 32768) for kernel in ("torch-varlen", "fa4-varlen")}
    assert keys["torch-varlen"] != keys["fa4-varlen"] and keys["torch-varlen"].file_name() != keys["fa4-varlen"].file_name()
    assert "fa4-varlen" in str(keys["fa4-varlen"])


def test_deterministic_mode_reaches_the_kernel(monkeypatch):
    """``--deterministic-mode`` is megatron-core's ``deterministic_mode``, which the elastic attention hands to
    flash-attn-4's call (its backward then accumulates dQ in a fixed order) and to its probe."""
    from megatron_epp.config.parser import parse_config
    from megatron_epp.executor.context import ChunkView
    from megatron_epp.plan import Chunk, Segment

    cfg = parse_config(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
                        "--mock-data", "--global-batch-size", "2", "--train-iters", "1", "--deterministic-mode"], world_size=1)
    assert cfg.model.deterministic_mode
    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs["deterministic"])
        return reference_fa4_varlen_func(*args, **kwargs)

    use_fa4(monkeypatch, fa4.CuteFlashKernel(recording, "recording", devices=("cpu",), dtypes=(torch.float32,), architectures=None))
    monkeypatch.setenv(kernels.ENV, "fa4")
    attention = make_attention(4, 2, 8)
    attention.deterministic = cfg.model.deterministic_mode  # what ElasticAttention reads from its config
    with attention.context.running(ChunkView.build(Chunk(0, "batched", [Segment(0, 0, 4)]), [4], CPU)):
        attention(torch.randn(4, 1, 4, 8), torch.randn(4, 1, 2, 8), torch.randn(4, 1, 2, 8))
    assert calls == [True, True]  # the probe's call, then the chunk's
