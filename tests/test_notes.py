"""ckptfix.notes: a note is its text (a str, as results and --json read it), its kind and its level."""

from __future__ import annotations

import copy
import json
import pickle

from ckptfix.notes import Kind, Level, Note, always, kind_of, level_of


def test_a_note_reads_as_its_text() -> None:
    note = Note("fast path not taken: the torch path was asked for", kind=Kind.ROUTE)
    assert note == "fast path not taken: the torch path was asked for"
    assert isinstance(note, str)
    assert json.dumps([note]) == '["fast path not taken: the torch path was asked for"]'
    assert f"path: torch; {note}" == "path: torch; fast path not taken: the torch path was asked for"


def test_kind_and_level_are_kept_through_copies_and_pickles() -> None:
    note = always("tied keys written once: 'b' = 'a'", kind=Kind.TIES)
    for again in (copy.copy(note), copy.deepcopy(note), pickle.loads(pickle.dumps(note))):
        assert again == note
        assert (kind_of(again), level_of(again)) == (Kind.TIES, Level.ALWAYS)


def test_a_plain_string_is_a_detail_said_under_verbose() -> None:
    assert (kind_of("copied 3 tensors"), level_of("copied 3 tensors")) == (Kind.DETAIL, Level.VERBOSE)
    assert (kind_of(Note("x")), level_of(Note("x"))) == (Kind.DETAIL, Level.VERBOSE)
