"""The one stand-in for a local tier's group source in tests that run one process.

``LocalTier(group=...)`` takes an object with the protocol of ``checkpoint.group.BackgroundGroup``
(``current``, ``is_stale``, ``drop``, ``generation``, ``token``); ``NoGroup`` is that source when
the process is not distributed: no group, a world of one.
"""

from __future__ import annotations


class NoGroup:
    """No process group (``current()`` is None); ``token`` names the group's run when a test
    fakes a world of several ranks around it (the agreement's count keys on it)."""

    generation = 0

    def __init__(self, token: str | None = None) -> None:
        self.token = token

    def current(self) -> None:
        return None

    def is_stale(self) -> bool:
        return False

    def drop(self) -> None:
        pass
