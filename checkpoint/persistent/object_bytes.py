"""The ``torch.save`` archives of a checkpoint's small Python values, reused between saves.

DCP writes every non-tensor leaf of a state (an optimizer's hyperparameters and parameter
names, a step counter, a re-run machine's fields) as its own ``torch.save`` archive, built anew
at every save: ~0.12 ms of the writer thread's CPU (and GIL) per value, 3.9 ms per save of the
example's 32 values. Most of them do not change from one save to the next. An archive is reused
when its value is *exactly* the value it was built from (``_exact``): same types all the way
down, floats compared by their bits (``0.0`` and ``-0.0`` apart, a NaN equal to itself), so that
reuse is correct by construction: the archive kept loads back as a value exactly equal to the one
being saved. Any other value (a custom object, a dict) is archived afresh every time.

Owned by one ``SaveProtocol`` and used only by its writer thread.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Hashable
from typing import Any

import torch

_SCALARS = (type(None), bool, int, str, bytes)


def _exact(value: Any) -> Hashable | None:
    """A key equal for two values only when they are exactly the same value (same types all the
    way down, floats by their bits), so that one's archive loads back as the other; None for a
    value this cannot vouch for."""
    kind = type(value)
    if kind in _SCALARS:
        return (kind, value)
    if kind is float:
        return (kind, struct.pack("<d", value))
    if kind is tuple or kind is list:
        parts = tuple(map(_exact, value))
        return None if None in parts else (kind, parts)
    return None


class ObjectArchives:
    """``torch.save`` archives by exact value, kept while a save still uses them."""

    def __init__(self) -> None:
        self._last: dict[Hashable, bytes] = {}
        self._next: dict[Hashable, bytes] = {}

    def archive(self, value: Any) -> bytes:
        """``value``'s ``torch.save`` archive (the bytes DCP's planner writes for it)."""
        key = _exact(value)
        data = None if key is None else self._last.get(key)
        if data is None:
            buf = io.BytesIO()
            torch.save(value, buf)
            data = buf.getvalue()
        if key is not None:
            self._next[key] = data
        return data

    def end_save(self) -> None:
        """After a save's files are written: forget the archives it did not use."""
        self._last, self._next = self._next, {}
