"""Waiting, bounded, until an allocation's etcd cluster is healthy: every member answers its v3
status request and names a leader (stdlib HTTP: no client library needed)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import InprocessError
from restartable.inprocess.etcd.allocation import AllocationCluster

_POLL_S = 0.2  # between two rounds of status requests
_REQUEST_S = 1.0  # one status request (a member that accepts and hangs is asked again later)


class ClusterNotHealthy(InprocessError, RuntimeError):
    """The allocation's etcd cluster was not healthy in time (torch-free, unlike the store's
    ``EtcdTimeoutError``: the batch script's ``wait`` does not import torch)."""


def member_state(endpoint: str, *, timeout: float = _REQUEST_S) -> str | None:
    """None when the member at ``endpoint`` (host:port) answers and knows a leader; else what
    is wrong, in words ("no leader yet", "connection refused", ...)."""
    req = urllib.request.Request(
        f"http://{endpoint}/v3/maintenance/status", data=b"{}", method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status = json.loads(resp.read())
    except urllib.error.URLError as exc:
        return str(exc.reason)
    except (OSError, ValueError) as exc:
        return str(exc) or type(exc).__name__
    if not isinstance(status, dict) or int(str(status.get("leader", 0))) == 0:
        return "no leader yet"
    return None


def wait_healthy(cluster: AllocationCluster, *, timeout: float, clock: Clock = SYSTEM) -> float:
    """Block until every member is healthy; the seconds it took. ``ClusterNotHealthy`` after
    ``timeout`` seconds, naming each member that was not and why."""
    start = clock.monotonic()
    deadline = start + timeout
    while True:
        states = {n: member_state(cluster.endpoint(n)) for n in cluster.nodes}
        bad = {n: s for n, s in states.items() if s is not None}
        if not bad:
            return clock.monotonic() - start
        if clock.monotonic() >= deadline:
            listed = "; ".join(f"{n} ({cluster.endpoint(n)}): {s}" for n, s in bad.items())
            raise ClusterNotHealthy(
                f"etcd in the allocation not healthy within {timeout:g} s: {listed}. The job "
                "output holds each member's log; check that the port is free on every node "
                "(ETCD_PORT, ETCD_PORT + 1) or raise ETCD_START_TIMEOUT"
            )
        clock.sleep(_POLL_S)
