"""The signal that a stream does not apply, and its reasons: :class:`ckptfix.formats.copyable.Fallback` and
:class:`~ckptfix.formats.copyable.Reason`, under the name the stream modules and callers import them by."""

from __future__ import annotations

from ckptfix.formats.copyable import Fallback, Reason

__all__ = ["Fallback", "Reason"]
