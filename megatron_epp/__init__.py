"""megatron-epp: Elastic Pipeline Parallelism for Megatron-Core (docs/architecture.md: the packages)."""

import warnings

# megatron-core warns at import that the optional GPU extras are absent: expected on CPU machines, and they would
# stand before the one-line error of a bad flag (pretrain_gpt.py, python -m megatron_epp.training.main, the tools).
warnings.filterwarnings("ignore", message="(Transformer Engine and )?Apex (is|are) not installed")
