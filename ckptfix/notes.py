"""What a command says beside its result: a :class:`Note` is its text, its kind and its level, decided where it is made.

The CLI shows each note by these two (``convert`` says a ``TIES`` note on a line of its own, a ``ROUTE`` note in its
"path:" line, an ``ALWAYS`` note whatever the verbosity; ``ckptfix.load`` warns with a ``LOSS`` note), never by how
its sentence starts. A :class:`Note` is a :class:`str` (its text), so that results users read as lists of strings
(``Conversion.notes``, ``MergeResult.notes``, ``--json``) stay as they were; a plain string among them is a note of
the default kind and level (:func:`kind_of`, :func:`level_of`).

It imports nothing of ckptfix: every layer makes notes.
"""

from __future__ import annotations

import enum


class Kind(enum.Enum):
    """What a note is about: which decides where the CLI puts it."""

    DETAIL = "detail"  # what was done, copied or shared
    ROUTE = "route"  # why the fast path was not taken (``fast path not taken: …``)
    TIES = "ties"  # tied names a file stores once or a .pt gets back: said on a line of its own
    LOSS = "loss"  # a value read back, or a resume, gets less than the input held: warned where it is loaded


class Level(enum.Enum):
    """When the CLI says a note: under ``--verbose`` only, or whatever the verbosity."""

    VERBOSE = "verbose"
    ALWAYS = "always"


class Note(str):
    """A note's text (the :class:`str` itself), its :class:`Kind` and its :class:`Level`."""

    __slots__ = ("kind", "level")
    kind: Kind
    level: Level

    def __new__(cls, text: str, *, kind: Kind = Kind.DETAIL, level: Level = Level.VERBOSE) -> Note:
        note = super().__new__(cls, text)
        note.kind, note.level = kind, level
        return note

    def __reduce__(self) -> tuple[object, ...]:  # pickled and copied with its kind and level
        return _note, (str(self), self.kind, self.level)


def _note(text: str, kind: Kind, level: Level) -> Note:
    return Note(text, kind=kind, level=level)


def always(text: str, *, kind: Kind = Kind.DETAIL) -> Note:
    """A note said whatever the verbosity."""
    return Note(text, kind=kind, level=Level.ALWAYS)


def kind_of(note: str) -> Kind:
    """``note``'s kind; a plain string's is :attr:`Kind.DETAIL`."""
    return note.kind if isinstance(note, Note) else Kind.DETAIL


def level_of(note: str) -> Level:
    """``note``'s level; a plain string's is :attr:`Level.VERBOSE`."""
    return note.level if isinstance(note, Note) else Level.VERBOSE


__all__ = ["Kind", "Level", "Note", "always", "kind_of", "level_of"]
