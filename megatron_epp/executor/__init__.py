"""Runs a Plan on Megatron-Core stages (torch): the elastic 1F1B schedule (:mod:`.schedule`), the
per-chunk context it hands to the layers (:mod:`.context`), per-chunk batches and the forward step
(:mod:`.batches`), and the layer-spec pieces (:mod:`.spec`: attention and its kernels, chunk RoPE,
the recompute layer) plus the activation-memory tracker."""
