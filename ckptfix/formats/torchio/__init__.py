"""The torch path: real tensors built from a checked description, ``torch.load`` of the rest, ``torch.save``."""
