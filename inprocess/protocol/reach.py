"""Whether any of a store's endpoints can be reached at all: the door checks of the launcher
(``inprocess.launch.doors``: node 0's host, the etcd cluster) and of a rank's first connect to
etcd (``inprocess.restart.startup``), so a mistyped host is one line at once instead of a store
timeout of retries. Torch-free."""

from __future__ import annotations

import socket
from collections.abc import Iterable


def unreachable(
    endpoints: Iterable[tuple[str, int]], *, connect: float | None = None
) -> str | None:
    """None when some endpoint's host resolves (and, with ``connect`` seconds, accepts a TCP
    connection within that); otherwise what failed at each, ``host:port: why; ...``. Stops at
    the first endpoint that passes."""
    problems = []
    for host, port in endpoints:
        problem = _problem(host, port, connect)
        if problem is None:
            return None
        problems.append(f"{host}:{port}: {problem}")
    return "; ".join(problems)


def _problem(host: str, port: int, connect: float | None) -> str | None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return "unknown host"
    if connect is None:
        return None
    last = "no address"
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(connect)
            try:
                s.connect(addr)
                return None
            except TimeoutError:
                last = f"no answer within {connect:g} s"
            except OSError as exc:
                last = (exc.strerror or type(exc).__name__).lower()
    return last
