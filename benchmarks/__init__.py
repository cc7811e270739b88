"""The benchmarks and measurement tools of this repository, run from its root as ``python -m benchmarks.NAME``
(``torchrun ... -m benchmarks.profile_executor`` for the one launched per rank); what they share is in
:mod:`benchmarks.common`, the attention harness of the CUDA check and the CPU contract tests in
:mod:`benchmarks.attention_harness`. Not shipped with the library (pyproject.toml says why)."""
