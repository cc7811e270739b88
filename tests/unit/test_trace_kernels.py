"""benchmarks/trace_kernels.py: a profiled step's device time by kernel class, from a PyTorch profiler trace."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import trace_kernels

KERNELS = [  # (name as such kernels appear in CUDA traces, its class)
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>(Flash_fwd_params)", "attention"),
    ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__tensor", "attention"),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", "norm"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "triton"),
    ("_rms_norm_forward_kernel", "norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "reduction"),
    ("some_unknown_thing", "other"),
]


def test_kernel_names_fall_in_their_classes():
    assert [trace_kernels.kernel_class(name) for name, _ in KERNELS] == [label for _, label in KERNELS]


def trace(tmp_path, events, gz=False):
    path = tmp_path / ("w.1.pt.trace.json" + (".gz" if gz else ""))
    text = json.dumps({"traceEvents": events})
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_a_step_is_summed_by_class_with_the_device_busy_share(tmp_path, capsys, gz):
    events = [{"ph": "X", "cat": "kernel", "name": KERNELS[0][0], "dur": 600.0}, {"ph": "X", "cat": "kernel", "name": KERNELS[2][0], "dur": 300.0},
              {"ph": "X", "cat": "kernel", "name": KERNELS[5][0], "dur": 100.0}, {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 50.0},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 5000.0}, {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#9", "dur": 2000.0}]
    path = trace(tmp_path, events, gz)
    assert trace_kernels.main([str(tmp_path), "--iteration", "9"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["trace"] == str(path) and report["iteration"] == 9 and report["kernels"] == 3 and report["steps"] == 1
    assert report["kernel_ms"] == 1.0 and report["wall_ms"] == 2.0 and report["busy_share"] == 0.5 and report["copies_ms"] == 0.05
    assert report["classes"] == {"attention": {"ms": 0.6, "share": 0.6}, "gemm": {"ms": 0.3, "share": 0.3}, "triton": {"ms": 0.1, "share": 0.1}}
    assert list(report["classes"]) == ["attention", "gemm", "triton"]  # largest first


def test_no_trace_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        trace_kernels.main([str(tmp_path)])
    assert stop.value.code == 2 and capsys.readouterr().err.strip() == f"trace_kernels: error: no *.pt.trace.json under {tmp_path}"
