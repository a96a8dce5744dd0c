"""torch.distributed.checkpoint (DCP) folders."""
