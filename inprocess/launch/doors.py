"""The launcher's checks at the door: a setting the job cannot start with ends the launcher in one
line and status 2 within seconds, before any rank starts (never status 75, which asks the
scheduler to requeue a job that would fail the same way again).

``admit`` parses the flags (``inprocess.launch.flags``) and ``check``s what only the machine can
tell (the script file, node 0's host name, the store's endpoints). Torch-free: ``python -m
restartable.launch`` answers before it imports torch (2-6 s).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.launch import autoresume
from restartable.inprocess.launch.flags import parse_args
from restartable.inprocess.protocol.reach import unreachable
from restartable.inprocess.usage import EXIT_USAGE

# How long the store's endpoints get to answer at the door. A live etcd member answers its
# status request in milliseconds, leader or not; three endpoints that each time out take
# 3 x _CONNECT_S plus this, still within the 10 s a newcomer waits for an error.
_PROBE_S = 3.0
_CONNECT_S = 1.0


def admit(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's flags, parsed and checked; exits with status 2 and one line when the job
    cannot start with them (``SystemExit``, as argparse does for a bad flag)."""
    args = parse_args(argv)
    problem = check(args)
    if problem is not None:
        sys.exit(refuse(args, problem))
    return args


def refuse(args: argparse.Namespace, problem: str) -> int:
    """The job cannot start: one line, status 2, and no autoresume flag (a stale one would
    requeue a job that fails the same way)."""
    print(f"python -m restartable.launch: error: {problem}", file=sys.stderr, flush=True)
    autoresume.settle(
        args.autoresume_file,
        status=EXIT_USAGE,
        reason=problem,
        attempt=0,
        max_retries=args.num_job_retries_on_failure,
    )
    return EXIT_USAGE


def check(args: argparse.Namespace, *, clock: Clock = SYSTEM) -> str | None:
    """What stops this node's launcher from starting the job, in one line (None: nothing).

    Looks at the script file, node 0's host (several nodes without ``--store``) and the etcd
    cluster (``--store``): at most about 10 s when every endpoint hangs."""
    return _script(args.script) or _master(args) or (_store(args, clock) if args.store else None)


def _script(path: str) -> str | None:
    where = f"in {os.getcwd()}" if not os.path.isabs(path) else "on this node"
    if not os.path.exists(path):
        return f"the script ({path}) does not exist {where}: give the path of the training script"
    if os.path.isdir(path):
        return f"the script ({path}) is a directory: give the path of the training script in it"
    if not os.access(path, os.R_OK):
        return f"the script ({path}) is not readable by this user: chmod u+r {path}"
    return None


def _master(args: argparse.Namespace) -> str | None:
    if args.store or args.nnodes == 1:
        return None
    # Resolving only: node 0's launcher may well start after this one.
    why = unreachable([(args.master_addr, args.master_port)])
    if why is None:
        return None
    return (
        f"--master-addr ({args.master_addr}) does not resolve ({why}): give node 0's host name "
        "or address, the same on every node"
    )


def _store(args: argparse.Namespace, clock: Clock) -> str | None:
    """The etcd cluster of ``--store``: some endpoint must accept a connection and answer the
    v3 status request (the store's own check), within ``_PROBE_S``."""
    from restartable.inprocess.errors import ConfigError
    from restartable.inprocess.etcd.endpoints import Endpoints
    from restartable.inprocess.etcd.errors import EtcdStoreError, EtcdTimeoutError
    from restartable.inprocess.etcd.url import parse_url

    url = args.store
    address = parse_url(url)  # checked by parse_args
    why = unreachable(address.endpoints, connect=_CONNECT_S)
    if why is not None:
        return (
            f"--store ({url}): no endpoint can be reached ({why}): correct the hosts and "
            "ports, or start the etcd cluster (docs/etcd.md)"
        )
    try:
        endpoints = Endpoints(address, request_timeout=_CONNECT_S)
        try:
            endpoints.probe(deadline=clock.monotonic() + min(_PROBE_S, args.node_timeout))
        finally:
            endpoints.close()
    except (ConfigError, EtcdStoreError) as exc:
        return f"--store ({url}): {exc}"
    except EtcdTimeoutError:  # it accepts connections but does not answer
        return (
            f"--store ({url}): no endpoint answered etcd's status request within "
            f"{_PROBE_S:g} s: check that these are etcd's client ports "
            "(2379 by default) and that the cluster is healthy (docs/etcd.md)"
        )
    return None
