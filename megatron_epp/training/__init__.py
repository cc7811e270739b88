"""Training: pretrain_gpt.py's run on megatron-core with the elastic executor."""
