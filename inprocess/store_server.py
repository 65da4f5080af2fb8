"""Hosting of and connecting to the coordination store (never inside a training process).

``python -m inprocess.store_server --port P --world-size N`` runs a detached TCPStore server; it
exits when every rank has left the job (``restartable/left`` reaches N), or after
``--idle-timeout`` seconds without any key change.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any

import torch.distributed as dist

from inprocess.environment import LaunchEnv
from inprocess.store import ROOT

log = logging.getLogger(__name__)

LEFT_KEY = ROOT + "left"  # every rank adds 1 when it leaves the wrapper for good
_POLL_S = 1.0  # server housekeeping cadence; not on any rank's critical path


def connect(env: LaunchEnv, *, timeout: float) -> dist.TCPStore:
    """A client of the job's store; rank 0 first starts the server if nobody hosts one.

    Blocks until the server answers, at most ``timeout`` seconds (the client retries).
    """
    if not env.store_hosted and env.rank == 0:
        spawn_server(port=env.master_port, world_size=env.world_size, host=env.master_addr)
    return client(env.master_addr, env.master_port, timeout=timeout)


def client(host: str, port: int, *, timeout: float) -> dist.TCPStore:
    """One more client connection (the monitor thread has its own)."""
    return dist.TCPStore(
        host,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def listening_server(host: str, port: int, **kw: Any) -> dist.TCPStore:
    """A TCPStore server listening on ``host`` only (torch binds every interface whatever
    address it is given, so the socket is bound here and handed over). When ``host`` is not an
    address of this machine (a name for a virtual IP, ...), it listens on every interface, with
    a warning: the secret still protects the values, but anyone can reach the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        log.warning("cannot listen on %s:%d only (%s): the store listens on every interface",
                    host, port, exc)  # fmt: skip
        return dist.TCPStore("0.0.0.0", port, is_master=True, **kw)
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, master_listen_fd=sock.detach(), **kw)


def spawn_server(
    *, port: int, world_size: int, idle_timeout: float = 3600.0, host: str = "0.0.0.0"
) -> int:
    """Start the detached server process (own session: a signal to the rank spares it)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inprocess.store_server",
            "--port",
            str(port),
            "--world-size",
            str(world_size),
            "--idle-timeout",
            str(idle_timeout),
            "--host",
            host,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    log.info("started store server pid %d on port %d", proc.pid, port)
    return proc.pid


def mark_left(store: dist.Store) -> int:
    """This rank leaves the job (the server exits once all have); returns how many ranks have
    left, this one included."""
    return int(store.add(LEFT_KEY, 1))


def serve(*, port: int, world_size: int, idle_timeout: float, host: str = "0.0.0.0") -> None:
    """Run a server until all ranks left or nothing changed for ``idle_timeout`` seconds."""
    server = listening_server(host, port, wait_for_workers=False)
    last_keys, last_change = -1, time.monotonic()
    while True:
        time.sleep(_POLL_S)
        if server.check([LEFT_KEY]) and server.add(LEFT_KEY, 0) >= world_size:
            return
        n = server.num_keys()
        if n != last_keys:
            last_keys, last_change = n, time.monotonic()
        elif time.monotonic() - last_change > idle_timeout:
            return


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--idle-timeout", type=float, default=3600.0)
    p.add_argument("--host", default="0.0.0.0", help="the address to listen on (MASTER_ADDR)")
    args = p.parse_args(argv)
    serve(
        port=args.port, world_size=args.world_size, idle_timeout=args.idle_timeout, host=args.host
    )


if __name__ == "__main__":
    main()
