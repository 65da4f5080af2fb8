"""The launcher's flags: the parser, the value rules, and the job id with ``--store``.

Torch-free, like ``inprocess.launch.doors``, so a bad command line is answered before the
launcher imports torch (2-6 s); only ``--store`` imports it (the etcd modules do). torchrun's
spellings are read too (``inprocess.launch.torchrun_flags``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import uuid
from collections.abc import Sequence

from restartable.inprocess.faults.drill import FAULT_TYPES
from restartable.inprocess.launch import torchrun_flags
from restartable.inprocess.launch.pool import DEFAULT_PRELOAD
from restartable.inprocess.protocol import environment
from restartable.inprocess.usage import UsageParser

_DEFAULT_PORT = 29500  # torchrun's default, for multi-node jobs that name no port


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's flags (torchrun's spellings too: ``torchrun_flags.spell``); a bad value
    exits with status 2 and one line naming the flag, the value and the fix."""
    p = _parser()
    args = p.parse_args(torchrun_flags.spell(sys.argv[1:] if argv is None else argv, p))
    _check_args(p, args)
    return args


def _parser() -> argparse.ArgumentParser:
    """Every flag of the launcher (``parse_args`` checks their values)."""
    p = UsageParser(
        prog="python -m restartable.launch",
        description="Start the ranks of one node; host the coordination store on node 0; "
        "respawn lost processes, restart the job in place, ask the scheduler for a requeue.",
    )
    p.add_argument(
        "--nproc-per-node",
        type=torchrun_flags.nproc,
        required=True,
        help="ranks on this node: a count, or gpu, cpu, auto (as torchrun)",
    )
    p.add_argument(
        "--nnodes", type=torchrun_flags.nnodes, default=1, help="number of nodes (default 1)"
    )
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1", help="host of the store (node 0)")
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="store port (default: a free port on one node, 29500 with several nodes)",
    )
    p.add_argument(
        "--store",
        default=os.environ.get("INPROCESS_STORE") or None,
        metavar="URL",
        help="the ranks' coordination store on an etcd cluster, etcd://h1:2379,h2:2379,h3:2379 "
        "(default: $INPROCESS_STORE; none: node 0's launcher hosts a TCPStore); docs/etcd.md",
    )
    p.add_argument(
        "--job-id",
        default=os.environ.get("INPROCESS_JOB_ID") or None,
        help="with --store: the job's key namespace, the same on every node (default: "
        "$INPROCESS_JOB_ID, $SLURM_JOB_ID.$SLURM_STEP_ID, or a new uuid with --nnodes 1)",
    )
    _add_recovery_flags(p)
    d = p.add_argument_group("fault drill (FaultToleranceConfig names)")
    d.add_argument("--simulated-fault-type", choices=FAULT_TYPES, default=None)
    d.add_argument("--simulated-fault-rank", type=int, default=None)
    d.add_argument("--simulated-fault-base-delay", type=float, default=0.0)
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def _add_recovery_flags(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("recovery (for @restartable scripts; all off by default)")
    r.add_argument(
        "--max-respawns",
        type=int,
        default=0,
        help="fresh processes started in the slot of a rank that died, per slot and round; "
        "the new process joins the reserve pool (default 0: off)",
    )
    r.add_argument(
        "--respawn-backoff",
        type=float,
        default=1.0,
        help="seconds before respawning a slot whose process died at start-up twice in a row; "
        "doubled each further time (default 1.0)",
    )
    r.add_argument(
        "--max-restarts",
        "--num-in-job-restarts",
        dest="max_restarts",
        type=int,
        default=0,
        help="in-job restarts (every rank restarted from its newest checkpoint) when the "
        "in-process restart gives up (default 0: the job ends with status 75)",
    )
    r.add_argument(
        "--num-job-retries-on-failure",
        type=int,
        default=2,
        help="job attempts the autoresume flag may ask the scheduler for (default 2)",
    )
    r.add_argument(
        "--autoresume-file",
        default=None,
        help="flag file written when the job should be requeued (status 75), removed otherwise",
    )
    r.add_argument(
        "--restart-by",
        choices=("rank", "node"),
        default=None,
        help="who meets at the job's store (TCPStore or --store etcd) in a restart. node "
        "(the default up to 31 processes per node, rank above): this launcher, for its node's "
        "ranks, which wait on a store of the node "
        "-- 3 store calls per node and restart instead of ~9 per rank, each rank's waits local; "
        "rank: every rank itself (as under plain torchrun or srun). "
        "docs/scale.md#the-node-path-one-relay-per-node",
    )
    _add_pool_flags(r)
    _add_timing_flags(r)


def _add_timing_flags(r: argparse._ArgumentGroup) -> None:
    """How often the launcher looks, and how long it waits for other launchers and ranks."""
    r.add_argument(
        "--monitor-interval",
        type=float,
        default=0.1,
        help="seconds between two looks at the ranks and the store (default 0.1)",
    )
    r.add_argument(
        "--node-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the other nodes' launchers before a round (default 60)",
    )
    r.add_argument(
        "--stop-grace",
        type=float,
        default=5.0,
        help="SIGTERM -> SIGKILL delay when the launcher stops its ranks (default 5)",
    )


def _add_pool_flags(r: argparse._ArgumentGroup) -> None:
    r.add_argument(
        "--no-warm-pool",
        dest="warm_pool",
        action="store_false",
        help="start respawned and restarted ranks cold (python, imports, script) instead of "
        "forking them from the node's pre-started fork server (docs/launching.md#warm-pool)",
    )
    r.add_argument(
        "--preload",
        default="",
        metavar="MODULES",
        help="comma-separated modules the warm pool imports before forking, besides "
        f"{','.join(DEFAULT_PRELOAD)}: only modules whose import starts no thread, no CUDA "
        "context and no socket",
    )


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit (``p.error``) on a bad value, naming the flag, the value and the rule."""
    for name in ("nproc_per_node", "nnodes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 1")
    for name in ("max_respawns", "max_restarts", "num_job_retries_on_failure"):
        if getattr(args, name) < 0:
            p.error(
                f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 0: give 0 "
                "to turn this level off"
            )
    # Finite too: an infinite --stop-grace would never SIGKILL, an infinite --node-timeout
    # never notice a lost node.
    for name in ("monitor_interval", "node_timeout"):
        if not 0 < getattr(args, name) < math.inf:
            p.error(
                f"--{name.replace('_', '-')} ({getattr(args, name)}) must be > 0 seconds and finite"
            )
    for name in ("respawn_backoff", "stop_grace", "simulated_fault_base_delay"):
        if not 0 <= getattr(args, name) < math.inf:
            p.error(
                f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 0 seconds "
                "and finite"
            )
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank ({args.node_rank}) must be in [0, --nnodes={args.nnodes})")
    world = args.nnodes * args.nproc_per_node
    if args.simulated_fault_rank is not None and not 0 <= args.simulated_fault_rank < world:
        p.error(
            f"--simulated-fault-rank ({args.simulated_fault_rank}) must be in [0, {world}): "
            "name a rank of the job, or omit it for a random one"
        )
    if args.nnodes > 1 and args.master_port is None:
        args.master_port = _DEFAULT_PORT
    if args.store is not None:
        _check_store(p, args)
    _settle_restart_by(p, args)


def _settle_restart_by(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--restart-by: node by default; rank where a node runs more processes than the node
    barrier's local count holds (``node_barrier.SLOTS``), which the launcher then logs."""
    from restartable.inprocess.protocol.node_barrier import SLOTS

    if args.restart_by is None:
        args.restart_by = "node" if args.nproc_per_node <= SLOTS else "rank"
    elif args.restart_by == "node" and args.nproc_per_node > SLOTS:
        p.error(
            f"--restart-by node with --nproc-per-node {args.nproc_per_node}: a node's barrier "
            f"counts at most {SLOTS} processes; give --restart-by rank (or omit the flag)"
        )


def _check_store(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validate --store and settle the job id (every launcher of the job must find the same)."""
    from restartable.inprocess.errors import ConfigError
    from restartable.inprocess.etcd.url import check_job_id, parse_url

    try:
        address = parse_url(args.store)
        if args.job_id is not None:
            args.job_id = check_job_id(args.job_id, where="--job-id")
    except ConfigError as exc:
        p.error(str(exc))
    if address.prefix is not None or args.job_id is not None:
        return
    step = environment.slurm_job_step()
    if step is not None:  # the job step: two srun steps of one allocation never share keys
        args.job_id = step
    elif args.nnodes == 1:
        args.job_id = f"launch-{uuid.uuid4().hex}"
    else:
        p.error(
            "--job-id is required with --store and --nnodes > 1 (outside Slurm): give every "
            "node's launcher the same id, for example --job-id $(date +%s)-myjob"
        )
