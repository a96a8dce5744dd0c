"""Prove, at C speed, that a pickle uses only what the fast reader may hand to the C unpickler.

:func:`provable` walks the opcodes of a pickle up to its first STOP with one regular expression per run of
opcodes (each alternative consumes exactly one opcode and its argument, so the runs split the bytes exactly
where an unpickler does). It says yes only when every opcode is one torch's weights-only loader reads and:

- every ``BUILD`` directly follows an ``EMPTY_DICT``, ``SETITEM`` or ``SETITEMS`` (memo puts between them
  allowed), so its state is a container, never ``None``: the C unpickler would silently accept a ``None``
  state on a list or dict, which the reference reader refuses;
- no ``APPENDS`` directly follows its ``MARK``: the C unpickler does nothing for an empty APPENDS, the
  reference reader still looks up the target's ``extend``/``append`` and refuses a dict;
- every ``LONG_BINPUT`` index stays below about the pickle's length: the C unpickler sizes its memo array by
  the largest index it is given, so a 4 GiB index in a 50-byte file would be a 64 GiB allocation.

Everything else (other opcodes, a truncated argument, no STOP) is simply "not proven": the caller then reads
the pickle with the reference reader, which gives the answer and the message.
"""

from __future__ import annotations

import functools
import re

# Opcodes without an argument (BUILD, STOP and MARK are handled apart).
_BARE = b"ae" + b"Q}])" + b"\x8f\x89\x81\x88NRsut\x85\x86\x87"
_BARE_CLASS = b"[" + b"".join(re.escape(bytes([c])) for c in _BARE) + b"]"


def _counted(op: bytes, width: int, below: int) -> bytes:
    """``op``, a little-endian length of ``width`` bytes below ``below``, then that many bytes.

    Each length is one alternative (a regular expression cannot count): a few dozen keep the compile short,
    longer arguments go through :func:`provable`'s loop.
    """
    sizes = b"|".join(re.escape(n.to_bytes(width, "little")) + b".{%d}" % n for n in range(below))
    return re.escape(op) + b"(?:" + sizes + b")"


def _long_put(limit: int) -> bytes:
    """LONG_BINPUT (``r``) with an index below a bound that is at most about 2 × ``limit`` (and at least 2**16)."""
    if limit < 1 << 24:
        return b"r..[\\x00-" + re.escape(bytes([limit >> 16])) + b"]\\x00"
    return b"r...[\\x00-" + re.escape(bytes([min(limit >> 24, 255)])) + b"]"


@functools.lru_cache(maxsize=64)
def _run(scale: int) -> re.Pattern[bytes]:
    put = b"(?:q.|" + _long_put(scale << 16) + b")"
    one = b"|".join(
        (
            b"[}su]" + put + b"*b",  # BUILD with a container state (before the bare alternative, which would win)
            _BARE_CLASS,
            b"\\((?!e)",  # MARK, but not an empty APPENDS: the C unpickler skips it, the reference checks its target
            b"[Khq\\x80].",  # BININT1, BINGET, BINPUT, PROTO
            b"M..",  # BININT2
            b"[Jj]....",  # BININT, LONG_BINGET
            _long_put(scale << 16),
            b"G.{8}",  # BINFLOAT
            b"c[^\\n]*\\n[^\\n]*\\n",  # GLOBAL module\nname\n
            _counted(b"X", 4, 96),  # BINUNICODE: a key, a storage name
            _counted(b"\x8a", 1, 10),  # LONG1: a 64-bit int
        )
    )
    return re.compile(b"(?:" + one + b")*+", re.DOTALL)


# Opcodes with a counted argument, by the width of the count: handled one at a time when the pattern has not
# taken them (longer than it enumerates).
_COUNTED = {b"X": 4, b"U": 1, b"\x8a": 1}  # BINUNICODE, SHORT_BINSTRING, LONG1


def provable(data: bytes) -> bool:
    """True when ``data`` up to its first STOP holds only opcodes (and arguments) the fast reader handles."""
    scale = 1 << (len(data) >> 16).bit_length()  # LONG_BINPUT bound: a power of two, so few patterns compile
    run = _run(scale - 1).match
    end = len(data)
    pos = 0
    while True:
        match = run(data, pos)
        pos = match.end() if match else pos
        op = data[pos : pos + 1]
        if op == b".":
            return True
        width = _COUNTED.get(op)
        if width is None or pos + 1 + width > end:
            return False
        pos += 1 + width + int.from_bytes(data[pos + 1 : pos + 1 + width], "little")
        if pos > end:
            return False
