"""Megatron-Core ``torch_dist`` folders."""
