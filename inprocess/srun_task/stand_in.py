"""A killed launcher's stand-in (``inprocess.srun_task`` after its ``-m restartable.launch`` child
died by a signal): the job's end status, from evidence only, bounded.

Evidence, cheapest first, each look every ``_POLL_S``:

1. the end record next to the ``--autoresume-file`` flag (``inprocess.launch.outcome``: shared
   storage, stdlib only, read before torch is imported): whichever launcher ended first wrote it;
2. the launchers' control store: on etcd (``--store``), ``etcd_outcome`` waits there for the
   survivors' end status; the TCPStore on node 0 (without ``--store``; never for node 0's
   own launcher, whose store died with it): the stand-in beats
   and leaves in the dead launcher's name there and reads ``launch/end``. Each connection try is
   short (``_CONNECT_S``), never two 30 s timeouts on a store that is gone.

Node 0's store unreachable for ``--node-timeout`` seconds with no record: the outcome is unknown
(None), and so it is at ``timeout``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from collections.abc import Sequence

from restartable.inprocess.clock import Clock
from restartable.inprocess.launch.flags import parse_args as launch_args
from restartable.inprocess.launch.outcome import JobOutcome
from restartable.inprocess.protocol import environment
from restartable.inprocess.protocol.store import Store

log = logging.getLogger("restartable.inprocess.srun_task")

_POLL_S = 0.5  # how often the stand-in looks at the evidence
_CONNECT_S = 3.0  # one try to reach node 0's control store


def launcher_job_status(launch_argv: Sequence[str], timeout: float, clock: Clock) -> int | None:
    """The end status of the job a killed launcher (``launch_argv``: its arguments) belonged
    to; None when unknown (one node: nobody else ends it; or no evidence in time)."""
    a = launch_args(list(launch_argv))
    if a.nnodes == 1:
        return None
    outcome = JobOutcome(a.autoresume_file, environment.launch_id())
    if a.store is not None:
        return _on_etcd(a, outcome, timeout, clock)
    deadline = clock.monotonic() + timeout
    store: Store | None = None
    lost_since: float | None = None  # since when node 0's store could not be reached
    try:
        while clock.monotonic() < deadline:
            recorded = outcome.read()
            if recorded is not None:
                return recorded[0]
            # Node 0's launcher hosted the control store: it died with it, only the record can
            # say (never a connection try on a store known to be gone).
            if a.store is None and a.node_rank != 0:
                try:
                    store = store or _connect(a, outcome)
                    # Its own beat (not the launcher's: a restart must count this node gone):
                    # node 0's launcher waits for it before leaving.
                    store.set(f"launch/standin/{a.node_rank}", repr(clock.wall()))
                    if store.check(["launch/end"]):
                        return int(store.get("launch/end"))
                    lost_since = None
                except Exception as exc:
                    store, lost_since = None, lost_since or clock.monotonic()
                    log.debug("node 0's control store: %r", exc)
            else:
                lost_since = lost_since or clock.monotonic()  # the record only
            if lost_since is not None and clock.monotonic() - lost_since > a.node_timeout:
                log.warning(
                    "no end record and node 0's control store unreachable for --node-timeout "
                    "(%s s)",
                    a.node_timeout,
                )
                return None
            clock.sleep(_POLL_S)
        return None
    finally:
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(f"launch/left/{a.node_rank}", "1")


def _on_etcd(
    a: argparse.Namespace, outcome: JobOutcome, timeout: float, clock: Clock
) -> int | None:
    """On etcd nothing of the job lived in the killed launcher: the survivors train on and
    publish the end status there (the record first, if a launcher already ended)."""
    recorded = outcome.read()
    if recorded is not None:
        return recorded[0]
    from restartable.inprocess.srun_task.etcd_outcome import launcher_job_status as on_etcd

    return on_etcd(a, timeout, clock)


def _connect(a: argparse.Namespace, outcome: JobOutcome) -> Store:
    """A client of node 0's control store, sealed with the launch's key (the launchers' secret,
    found as they find it, and the launch id: this job attempt's, else node 0's token)."""
    # Before torch's import (it reads it once): a refused connection is this module's to tell,
    # not a C++ stack dump on the job's console. This process starts nothing after it.
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    from restartable.checkpoint.sealing import Sealer
    from restartable.inprocess.launch.cli import launch_secret
    from restartable.inprocess.launch.launch_id import TOKEN_KEY, launch_sealer
    from restartable.inprocess.protocol.sealed_store import seal
    from restartable.inprocess.store_server import client

    root = Sealer(launch_secret(a))
    raw = client(a.master_addr, a.master_port, timeout=_CONNECT_S)
    launch_id = outcome.launch_id
    if launch_id is None:
        launch_id = str(json.loads(seal(raw, root).get(TOKEN_KEY))["id"])
        outcome.launch_id = launch_id
    return seal(raw, launch_sealer(root, launch_id))
