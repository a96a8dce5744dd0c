"""What training frameworks write: transformers/accelerate folders, DCP, FSDP rank files, DeepSpeed ZeRO runs."""
