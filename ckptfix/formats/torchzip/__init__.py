"""torch's zip checkpoint (``torch.save`` since 1.6): the archive, its inert reading, its layout."""
