"""DeepSpeed ZeRO runs."""
