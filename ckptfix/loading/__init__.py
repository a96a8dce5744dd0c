"""Checkpoints loaded into models: key reports, ``load_into``, tensors placed, ``--model`` factories."""
