"""``python -m restartable.inprocess.etcd member|wait``: an etcd cluster inside a Slurm allocation,
for the job's store (examples/slurm/*.sbatch with ETCD=1;
docs/launching.md#etcd-inside-the-allocation).

    NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)
    srun --overlap --ntasks-per-node=1 python -m restartable.inprocess.etcd member \\
        --nodes "$NODES" --port 40000 --data-root /tmp/etcd-$SLURM_JOB_ID \\
        --token job-$SLURM_JOB_ID &
    export INPROCESS_STORE=$(python -m restartable.inprocess.etcd wait \\
        --nodes "$NODES" --port 40000)          # the launchers / ranks use INPROCESS_STORE
    kill -USR2 %1; wait                    # srun relays it: every member stops, data removed

The first nodes run a member (every node up to 3, then 3 or 5: ``default_members``); a task on
any other node exits 0 at once. ``wait`` prints the store URL once every member answers and a
leader is elected (status 1 with each member's state after ``--timeout`` seconds), and warns when
the cluster cannot lose a member (fewer than three).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from restartable.inprocess.errors import ConfigError
from restartable.inprocess.etcd.allocation import (
    AllocationCluster,
    default_members,
    sizing_warning,
    tolerated_losses,
)
from restartable.inprocess.etcd.health import ClusterNotHealthy, wait_healthy
from restartable.inprocess.etcd.member import Member, node_name

log = logging.getLogger("restartable.inprocess.etcd")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m restartable.inprocess.etcd",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, what in (("member", "run this node's member"), ("wait", "wait; print the URL")):
        s = sub.add_parser(name, help=what)
        s.add_argument("--nodes", required=True, help="the allocation's nodes, n1,n2,n3")
        s.add_argument("--port", type=int, required=True, help="client port (peers: port + 1)")
        if name == "member":
            s.add_argument(
                "--data-root",
                type=Path,
                required=True,
                help="node-local directory; the member's data in <root>/<node>",
            )
            s.add_argument("--token", required=True, help="the cluster's token, one per attempt")
        else:
            s.add_argument(
                "--timeout",
                type=float,
                default=60.0,
                help="seconds the cluster may take to be healthy (default 60)",
            )
    return p


def _cluster(args: argparse.Namespace) -> AllocationCluster:
    nodes = [n for n in args.nodes.split(",") if n]
    return AllocationCluster.resolve(nodes[: default_members(len(nodes))], args.port)


def member(args: argparse.Namespace) -> int:
    node = node_name()
    cluster = _cluster(args)
    if node not in cluster.nodes:
        return 0  # this node runs no member
    data_dir = args.data_root / node
    log.info("etcd member %s on %s (data %s)", node, cluster.endpoint(node), data_dir)
    return Member(cluster.member_argv(node, data_dir=data_dir, token=args.token), data_dir).run()


def wait(args: argparse.Namespace) -> int:
    if not 0 < args.timeout < math.inf:
        raise ConfigError(
            f"--timeout ({args.timeout}) must be a finite number of seconds > 0: the batch "
            "script passes ETCD_START_TIMEOUT (default 60)"
        )
    cluster = _cluster(args)
    n = len(cluster.nodes)
    warning = sizing_warning(n)
    if warning is not None:
        log.warning("%s", warning)
    took = wait_healthy(cluster, timeout=args.timeout)
    log.info(
        "etcd in the allocation: %d member(s) on %s, healthy after %.1f s; survives the loss "
        "of %d node(s)",
        n,
        ",".join(cluster.nodes),
        took,
        tolerated_losses(n),
    )
    print(cluster.url(), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[restartable.inprocess.etcd] %(message)s"))
    logging.getLogger("restartable.inprocess.etcd").addHandler(handler)
    logging.getLogger("restartable.inprocess.etcd").setLevel(logging.INFO)
    args = _parser().parse_args(argv)
    try:
        return member(args) if args.cmd == "member" else wait(args)
    except (ConfigError, ClusterNotHealthy) as exc:
        log.error("%s", exc)
        return 2 if isinstance(exc, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
