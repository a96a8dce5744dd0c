"""Every checkpoint format ckptfix reads and writes, grouped by concern.

- :mod:`containers`: one file's bytes: the zip archive, torch's zip checkpoint, the legacy torch format, safetensors.
- :mod:`pickles`: the one inert pickle reader and writer (nothing executed).
- :mod:`safety`: which globals a pickle may name, the opcode proof for the C unpickler, nesting depth.
- :mod:`folders`: what training frameworks write: HF shards and accelerate, DCP, FSDP rank files, DeepSpeed runs.
- :mod:`torchio`: the torch path: real tensors built from a description, ``torch.load`` of the rest, ``torch.save``.
- :mod:`output`: crash-safe output and the checksums every reader and writer checks.
- :mod:`registry`: which format a path is, and load/save/read/write by format; :mod:`dtypes`: the one dtype table.
"""
