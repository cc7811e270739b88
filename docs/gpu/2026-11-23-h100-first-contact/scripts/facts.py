"""First-contact helper: versions and which optional GPU packages import."""

import importlib
import platform
import sys

print("python", sys.version.split()[0], platform.platform())
try:
    import torch

    print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
          "nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print("gpu", p.name, f"cc {p.major}.{p.minor}", f"{p.total_memory / 2**30:.1f} GiB", f"SMs {p.multi_processor_count}")
        free, total = torch.cuda.mem_get_info()
        print(f"mem_get_info free {free / 2**30:.2f} GiB of {total / 2**30:.2f} GiB")
        print("sdpa flash/mem-eff/cudnn enabled:", torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled())
        print("matmul allow_tf32:", torch.backends.cuda.matmul.allow_tf32, "cudnn allow_tf32:", torch.backends.cudnn.allow_tf32)
    else:
        print("torch.cuda.is_available() = False")
except Exception as error:  # noqa: BLE001
    print("torch FAILED", type(error).__name__, error)
for name in ("flash_attn", "flash_attn_interface", "transformer_engine", "transformer_engine.pytorch", "apex",
             "scaled_masked_softmax_cuda", "megatron.core", "triton", "numpy", "scipy", "tokenizers", "psutil",
             "packaging", "einops", "tensorboard", "pytest"):
    try:
        m = importlib.import_module(name)
        print(f"import {name}: OK {getattr(m, '__version__', '')}")
    except Exception as error:  # noqa: BLE001
        print(f"import {name}: FAILED {type(error).__name__}: {str(error)[:160]}")
