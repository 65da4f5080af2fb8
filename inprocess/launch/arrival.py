"""The launchers' meeting before each round: every launcher counts itself in ``<ns>r{k}/arrived``
and waits until all ``nnodes`` did, so no round starts on some nodes only."""

from __future__ import annotations

from restartable.inprocess.clock import Clock
from restartable.inprocess.launch.control_store import ControlStore
from restartable.inprocess.launch.node_lost import NodeLostError

_POLL_S = 0.05  # how often a launcher looks at the count


class Arrival:
    """``JobControl.open_round(k)`` calls ``arrive(k)``, then (after its backend hosted the
    round's store) ``wait_for_all(k)``, which blocks at most ``node_timeout``."""

    def __init__(
        self, control: ControlStore, *, nnodes: int, node_timeout: float, clock: Clock
    ) -> None:
        self._control, self._nnodes = control, nnodes
        self._node_timeout, self._clock = node_timeout, clock

    def arrive(self, k: int) -> None:
        """Count this launcher in for round ``k`` (the store's errors propagate)."""
        self._control.store.add(self._control.key(f"r{k}/arrived"), 1)

    def wait_for_all(self, k: int) -> None:
        """Block until every launcher arrived for round ``k``; ``NodeLostError`` when one did
        not within ``node_timeout`` (the store's errors propagate)."""
        store, key = self._control.store, self._control.key(f"r{k}/arrived")
        deadline = self._clock.monotonic() + self._node_timeout
        while store.add(key, 0) < self._nnodes:
            if self._clock.monotonic() > deadline:
                n = store.add(key, 0)
                raise NodeLostError(
                    f"only {n} of {self._nnodes} launchers arrived for round {k} within "
                    f"--node-timeout ({self._node_timeout} s): a node is gone"
                )
            self._clock.sleep(_POLL_S)
