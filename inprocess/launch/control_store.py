"""The launchers' control store as each role of ``JobControl`` sees it: the store (sealed with
the launch's key) and the launch's key namespace (``launch/`` on the TCPStore, ``launch/<launch
id>/`` on etcd). One object shared by the roles, so that ``close()`` drops the store for all of
them at once (node 0: the last reference to the TCPStore server goes, and the server stops)."""

from __future__ import annotations

from restartable.inprocess.launch.node_lost import NodeLostError
from restartable.inprocess.protocol.store import Store


class ControlStore:
    """The control store of one launch and its namespace; built by ``JobControl`` once the
    launch id is settled, closed by ``JobControl.close()``."""

    def __init__(self, store: Store, ns: str) -> None:
        self._store: Store | None = store
        self.ns = ns

    @property
    def store(self) -> Store:
        """The sealed control store; ``NodeLostError`` once closed."""
        if self._store is None:
            raise NodeLostError("the control store is closed")
        return self._store

    def key(self, name: str) -> str:
        """``name`` in this launch's namespace (``<ns>name``)."""
        return self.ns + name

    def close(self) -> None:
        """Drop the store (its owner closes the client or server, if it needs closing)."""
        self._store = None
