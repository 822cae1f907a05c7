"""Megatron-core MoE mid-training: data path, trainer, Slurm launcher."""
