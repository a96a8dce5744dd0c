"""The signal that a stream does not apply: :class:`ckptfix.formats.copyable.Fallback`, under the name the stream
modules and callers import it by."""

from __future__ import annotations

from ckptfix.formats.copyable import Fallback

__all__ = ["Fallback"]
