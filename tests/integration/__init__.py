"""Tests that launch processes: torchrun runs, pretrain_gpt.py and scripts as a user runs them, SLURM, git and venv probes."""
