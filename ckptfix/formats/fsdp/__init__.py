"""FSDP rank files: DTensor (FSDP2) and ShardedTensor (FSDP1), flat parameters."""
