"""The one error of the launchers' coordination: another launcher, or the control store, is gone
(``NodeLostError``). Every role of ``JobControl`` raises it; ``inprocess.launch.cli`` ends the
job with a requeue on it."""

from __future__ import annotations

from restartable.checkpoint.sealing import ForgedValueError


class NodeLostError(Exception):
    """Another launcher (a node) did not answer in time, or node 0's store is gone."""


def store_lost(exc: BaseException) -> NodeLostError:
    """The ``NodeLostError`` for a failed control-store operation: a forged value stops the job
    as surely as a lost store, but says so."""
    if isinstance(exc, ForgedValueError):
        return NodeLostError(f"the control store holds a forged value, so the job stops: {exc}")
    return NodeLostError(f"the control store is gone (node 0's launcher, or etcd): {exc}")
