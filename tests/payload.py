"""The attacker's object of the crafted-input tests: unpickling it creates a file.

Its ``__reduce__`` is what a crafted pickle in a checkpoint, a store value or a header would
carry; a test that finds the file afterwards has shown that some reader ran code from its input.
"""

from __future__ import annotations

from pathlib import Path


class Payload:
    """Creates ``path`` when unpickled: the proof that something ran code from its input."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))
