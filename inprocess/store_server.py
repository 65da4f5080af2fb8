"""Hosting of and connecting to the coordination store (never inside a training process).

``python -m restartable.inprocess.store_server --port P --world-size N [--token T]`` runs a detached
TCPStore server. It exits once every rank of the job has left (``mark_left``) or is known to be
gone (its watchdog reported its death); with ``--wait-for-tasks`` (every rank runs under
``inprocess.srun_task``, which marks a dead rank as left once it has read the job's outcome) only
once every rank has left; or after ``--idle-timeout`` seconds without any key change. It ignores
SIGTERM: a scheduler that signals every process of the step (Slurm's proctrack/linuxproc) must
not take the store away from ranks that are writing their preemption checkpoint; it is ended by
the rules above, or by its owner (``inprocess.srun_task``, Slurm's end of the step).

``--token``: the launch id (``environment.launch_id``); the server publishes it, and every rank
checks it after connecting, so a rank never joins a store left over from another job or attempt
on the same port (it fails with an error that names both).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
from typing import Any

import torch.distributed as dist

from restartable.checkpoint.sealing import ForgedValueError, child_env, job_sealer
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.protocol.environment import LaunchEnv
from restartable.inprocess.protocol.keys import GONE_KEY, ROOT, parse_ranks, peek
from restartable.inprocess.protocol.sealed_store import seal
from restartable.inprocess.protocol.store import Store

log = logging.getLogger(__name__)

LEFT_KEY = ROOT + "left"  # every rank adds 1 when it leaves the wrapper for good
LEFT_RANKS_KEY = ROOT + "left_ranks"  # the identities that left, "0,3,"
TOKEN_KEY = ROOT + "token"  # the launch id of the server's job (--token)
_POLL_S = 1.0  # server housekeeping cadence; not on any rank's critical path


def connect(env: LaunchEnv, *, timeout: float) -> dist.TCPStore:
    """A client of the job's store; rank 0 first starts the server if nobody hosts one.

    Blocks until the server answers, at most ``timeout`` seconds (the client retries). When the
    server was started here (nobody hosts one) and the launch has an id, checks the server's
    token: ``ConfigError`` names a store of another launch that holds the port.
    """
    started_here = not env.store_hosted
    if started_here and env.rank == 0:
        spawn_server(
            port=env.master_port,
            world_size=env.world_size,
            host=env.master_addr,
            token=env.launch,
            wait_for_tasks=env.under_task,
        )
    store = client(env.master_addr, env.master_port, timeout=timeout)
    if started_here and env.launch:
        where = f"{env.master_addr}:{env.master_port}"
        check_token(store, env.launch, where=where, timeout=timeout)
    return store


def check_token(store: dist.Store, token: str, *, where: str, timeout: float) -> None:
    """Raise ``ConfigError`` unless the store at ``where`` belongs to launch ``token``."""
    try:
        store.wait([TOKEN_KEY], datetime.timedelta(seconds=timeout))
        found = store.get(TOKEN_KEY).decode()
    except Exception as exc:
        if "timeout" not in str(exc).lower() and not isinstance(exc, TimeoutError):
            raise
        found = "(none: a store that is not ours)"
    if found != token:
        raise ConfigError(
            f"the store at {where} belongs to launch {found}, not to this launch ({token}): "
            "a store server of an earlier job or attempt still holds MASTER_PORT; end it, or "
            "give this job another MASTER_PORT"
        )


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
        log.warning(
            "cannot listen on %s:%d only (%s): the store listens on every interface",
            host,
            port,
            exc,
        )
        return dist.TCPStore("0.0.0.0", port, is_master=True, **kw)
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, master_listen_fd=sock.detach(), **kw)


def spawn_server(
    *,
    port: int,
    world_size: int,
    idle_timeout: float = 3600.0,
    host: str = "0.0.0.0",
    token: str | None = None,
    wait_for_tasks: bool = False,
) -> int:
    """Start the detached server process (own session: a signal to the rank's process group
    spares it). ``token`` and ``wait_for_tasks``: see the module docstring."""
    argv = [
        sys.executable,
        "-m",
        "restartable.inprocess.store_server",
        "--port",
        str(port),
        "--world-size",
        str(world_size),
        "--idle-timeout",
        str(idle_timeout),
        "--host",
        host,
    ]
    if token:
        argv += ["--token", token]
    if wait_for_tasks:
        argv.append("--wait-for-tasks")
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        # Its view of the "left" list is sealed: it gets the secret this rank was handed.
        env=child_env({**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}),
    )
    log.info("started store server pid %d on port %d", proc.pid, port)
    return proc.pid


def mark_left(store: Store, identity: int) -> int:
    """Process ``identity`` leaves the job (the server exits once all have); returns how many
    have left. Idempotent per identity: the rank and, after its death, its ``inprocess.srun_task``
    may both mark it."""
    if store.add(f"{ROOT}left/{identity}", 1) == 1:
        store.append(LEFT_RANKS_KEY, f"{identity},")
        return int(store.add(LEFT_KEY, 1))
    return int(store.add(LEFT_KEY, 0))


def all_left(store: Store, world_size: int, *, count_gone: bool) -> bool:
    """Whether every rank 0..world_size-1 has left (or, with ``count_gone``, is gone)."""
    out = parse_ranks(peek(store, LEFT_RANKS_KEY))
    if count_gone:
        out |= parse_ranks(peek(store, GONE_KEY))
    return len(out & set(range(world_size))) >= world_size


def serve(
    *,
    port: int,
    world_size: int,
    idle_timeout: float,
    host: str = "0.0.0.0",
    token: str | None = None,
    wait_for_tasks: bool = False,
    clock: Clock = SYSTEM,
) -> None:
    """Run a server until the job is over (module docstring) or nothing changed for
    ``idle_timeout`` seconds of ``clock``, looking every ``_POLL_S``."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # see the module docstring
    server = listening_server(host, port, wait_for_workers=False)
    if token:
        server.set(TOKEN_KEY, token)
    # The ranks seal what they append to the "left" and "gone" lists; the rank that started this
    # server made the job's secret before (its environment or the job's private file).
    view = seal(server, job_sealer(create=False))
    last_keys, last_change = -1, clock.monotonic()
    while True:
        clock.sleep(_POLL_S)
        try:
            if all_left(view, world_size, count_gone=not wait_for_tasks):
                return
        except ForgedValueError:  # logged by the sealed view; only the idle timeout ends us now
            pass
        n = server.num_keys()
        if n != last_keys:
            last_keys, last_change = n, clock.monotonic()
        elif clock.monotonic() - last_change > idle_timeout:
            return


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--idle-timeout", type=float, default=3600.0)
    p.add_argument("--host", default="0.0.0.0", help="the address to listen on (MASTER_ADDR)")
    p.add_argument("--token", default=None)
    p.add_argument("--wait-for-tasks", action="store_true")
    args = p.parse_args(argv)
    serve(
        port=args.port,
        world_size=args.world_size,
        idle_timeout=args.idle_timeout,
        host=args.host,
        token=args.token,
        wait_for_tasks=args.wait_for_tasks,
    )


if __name__ == "__main__":
    main()
