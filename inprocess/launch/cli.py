"""``python -m restartable.launch``: start the ranks of one node, host the job's store, and recover
from lost processes, cheapest level first.

    python -m restartable.launch --nproc-per-node 4 --max-respawns 2 --max-restarts 3 \
        --autoresume-file ckpt/autoresume.json train.py --steps 100

Each rank gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*, and its defaults
OMP_NUM_THREADS=1 with several ranks, TORCH_NCCL_ASYNC_ERROR_HANDLING=1, unless set),
RESTARTABLE_SECRET (the job's secret that seals every store value: docs/security.md) and
INPROCESS_STORE_HOSTED=1 (with ``--store etcd://...``: INPROCESS_STORE and
INPROCESS_JOB_ID instead of a store hosted here; docs/etcd.md); its output lines are prefixed
with ``[rank N]`` (``[rank N.g]`` for the g-th respawn of that slot). Unlike torchrun, a rank
that exits does not take its siblings down (srun ``--kill-on-bad-exit=0`` semantics):
``@restartable`` replaces it in place. SIGINT / SIGTERM are forwarded to every rank (a second
one kills them).

A script without ``@restartable`` (an unmodified torchrun script) runs under the restart loop
that ``inprocess.script_mode`` writes for it: re-run in place after a fault (docs/script_mode.md).

Recovery (docs/launching.md): (2) respawn: a rank process that dies
(signal, crash) is replaced by a fresh one that joins the reserve pool (``--max-respawns`` per
slot, with backoff for start-up deaths); (3) in-job restart: when the in-process restart gives up,
every launcher restarts all its ranks, which resume from their newest checkpoint
(``--max-restarts``); (4) job retry: the job ends with status 75 and writes the
``--autoresume-file`` flag while ``--num-job-retries-on-failure`` allows.

Exit status (``inprocess.launch.autoresume``): 0 the job finished; 2 the job cannot start as
configured (a bad or unknown flag, a missing script, an unreachable store: one line, within
seconds, before any rank starts; or the script's own usage error); 17 a result failed
validation; 70 an application fault; 75 requeue (in-job restarts exhausted, a node lost,
preempted). For a script run plain (``INPROCESS_RESTART_IN_PLACE=0``): 0 when at least one rank
exited 0 and no rank exited with a non-zero status of
its own (a rank killed by a signal while the others finished is a rank the job survived);
otherwise the status of the first rank that failed, or 1 if every rank was killed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from restartable.checkpoint import sealing
from restartable.inprocess import journal
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.etcd.errors import EtcdStoreError
from restartable.inprocess.launch import autoresume, doors
from restartable.inprocess.launch.actions import Action

# where tests and task.py look
from restartable.inprocess.launch.flags import parse_args as parse_args
from restartable.inprocess.launch.launcher_journal import LauncherJournal
from restartable.inprocess.launch.launcher_round import run_round
from restartable.inprocess.launch.node_lost import NodeLostError
from restartable.inprocess.launch.outcome import JobOutcome
from restartable.inprocess.launch.pool import DEFAULT_PRELOAD, WarmPool
from restartable.inprocess.launch.rank_env import torchrun_defaults
from restartable.inprocess.launch.rounds import JobControl
from restartable.inprocess.launch.supervisor import NodeSupervisor, RoundEnd
from restartable.inprocess.protocol import environment, node_barrier
from restartable.inprocess.usage import EXIT_USAGE

log = logging.getLogger("restartable.inprocess.launch")


def _omp_notice(nproc_per_node: int) -> None:
    """torchrun's notice, once per launcher, when it sets OMP_NUM_THREADS for the ranks."""
    if "OMP_NUM_THREADS" in torchrun_defaults(nproc_per_node, os.environ):
        log.warning(
            "setting OMP_NUM_THREADS=1 for each rank (as torchrun does with several ranks per "
            "node) so that %d ranks do not overload the machine's cores; set OMP_NUM_THREADS "
            "to tune it",
            nproc_per_node,
        )


def job_status(returncodes: Sequence[int]) -> int:
    """The exit status of a job without ``@restartable`` (see the module docstring)."""
    own_failures = [rc for rc in returncodes if rc > 0]
    if own_failures:
        return own_failures[0]
    return 0 if any(rc == 0 for rc in returncodes) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job's rounds on this node; returns the exit status (module docstring)."""
    return run(doors.admit(argv))


def run(args: argparse.Namespace) -> int:
    """Run the job of ``args`` (admitted: ``doors.admit``) on this node; the exit status."""
    _log_to_stdout(args.node_rank)
    _omp_notice(args.nproc_per_node)
    jr = LauncherJournal(args.node_rank)
    try:
        return _main(args, jr)
    finally:
        jr.close()


def launch_secret(args: argparse.Namespace) -> bytes:
    """The job's secret (``checkpoint.sealing``), handed to the ranks in their environment (and
    found the same way by ``inprocess.srun_task`` standing in for a killed launcher):
    the environment's (``RESTARTABLE_SECRET`` / ``_FILE``), else a new one on one node, else the
    per-user file every node's launcher finds from the same --master-addr/--master-port/--store/
    --job-id (a shared home directory; docs/security.md)."""
    if sealing.handed() or os.environ.get(sealing.SECRET_FILE_ENV):
        secret = sealing.job_secret()
    elif args.nnodes == 1:
        secret = bytes.fromhex(sealing.new_secret())
    else:
        secret = sealing.job_secret(_shared_scope(args), create=args.node_rank == 0)
    assert secret is not None  # a scope is always given above
    return secret


def _shared_scope(args: argparse.Namespace) -> dict[str, str]:
    """The environment that names this job's per-user secret file (several nodes, no secret
    given): every node's launcher derives the same one from the same flags."""
    return {
        **os.environ,
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(args.master_port),
        "INPROCESS_STORE": args.store or "",
        "INPROCESS_JOB_ID": args.job_id or "",
    }


def _main(args: argparse.Namespace, jr: LauncherJournal) -> int:
    # Decided once, before anything of this attempt exists: read at the exit, the flag file may
    # already be another node's (written for this attempt), and the launchers would disagree.
    args.attempt = autoresume.attempt_number(args.autoresume_file)
    unusable = jr.unusable()
    if unusable is not None:  # before any rank starts: each of them would refuse it too
        return _finish(args, 1, unusable)
    try:
        secret = launch_secret(args)
    except (OSError, ValueError) as exc:
        return _finish(args, 1, f"cannot settle the job's secret: {exc}")
    try:
        control = _job_control(args, secret)
    except (ConfigError, EtcdStoreError) as exc:  # a requeue would fail the same way
        return doors.refuse(args, str(exc))
    except Exception as exc:
        return _finish(
            args, autoresume.EXIT_REQUEUE, f"cannot reach the job's control store: {exc}"
        )
    jr.start(control.launch_id)
    if args.restart_by == "rank" and args.nproc_per_node > node_barrier.SLOTS:
        log.info(
            "restart by rank: %d processes per node, more than the node path's %d",
            args.nproc_per_node,
            node_barrier.SLOTS,
        )
    try:
        with _warm_pool(args) as pool:
            return _rounds(args, control, jr, pool)
    finally:
        if args.node_rank == 0 and args.nnodes > 1:  # the shared file dies with its launch
            sealing.forget_shared_secret(_shared_scope(args))


def _warm_pool(args: argparse.Namespace) -> contextlib.AbstractContextManager[WarmPool | None]:
    """The node's warm pool when a respawn or an in-job restart may need it (started now: it
    imports while the first round starts cold), else nothing."""
    if not args.warm_pool or not (args.max_respawns or args.max_restarts):
        return contextlib.nullcontext()
    env = {**torchrun_defaults(args.nproc_per_node, os.environ), **os.environ}
    extra = [m.strip() for m in args.preload.split(",") if m.strip()]
    pool = WarmPool(env=env, preload=[*DEFAULT_PRELOAD, *extra])
    pool.start()
    return pool


def _rounds(
    args: argparse.Namespace, control: JobControl, jr: LauncherJournal, pool: WarmPool | None
) -> int:
    """The job's rounds on this node until it ends; the launcher's exit status."""
    current: list[NodeSupervisor] = []
    signals_seen = 0
    # The job's end, recorded once for every node (shared storage, next to the flag).
    outcome = JobOutcome(args.autoresume_file if args.nnodes > 1 else None, control.launch_id)

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal signals_seen
        signals_seen += 1
        for sup in current:
            sup.signal_children(signum if signals_seen == 1 else signal.SIGKILL)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        k = 0
        while True:
            end, action = run_round(args, control, k, current, jr, pool)
            if action is not None and action.kind == "restart":
                log.warning(
                    "in-job restart %d/%d: %s; every rank restarts and resumes from its newest "
                    "checkpoint",
                    k + 1,
                    args.max_restarts,
                    action.reason,
                )
                # t: the old ranks are gone and the new round begins; decided: when this node
                # saw the decision (the report's detection of an in-job restart).
                journal.record("in_job_restart", round=k + 1, reason=action.reason, decided=end.at)
                k += 1
                if signals_seen:  # a SIGINT / SIGTERM between two rounds: start nothing more
                    return _finish(args, autoresume.EXIT_REQUEUE, "signalled during a restart")
                continue
            status, reason = outcome.record(*_status(end, action))
            control.publish_end(status)
            control.leave()  # with etcd, the last launcher out deletes the job's keys
            return _finish(args, status, reason)
    except NodeLostError as exc:  # unless another node recorded the job's end first
        return _finish(args, *outcome.record(autoresume.EXIT_REQUEUE, str(exc)))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        control.close()


def _job_control(args: argparse.Namespace, secret: bytes) -> JobControl:
    """The launchers' control store for this attempt (raises when it cannot be reached)."""
    return JobControl(
        node_rank=args.node_rank,
        nnodes=args.nnodes,
        addr=args.master_addr,
        port=args.master_port,
        node_timeout=args.node_timeout,
        beat_stale=max(2.0, 20 * args.monitor_interval),
        store_url=args.store,
        job_id=args.job_id,
        # Under Slurm: one id per job attempt (a requeued attempt journals apart).
        launch_id=environment.launch_id(),
        sealer=sealing.Sealer(secret),
    )


def _status(end: RoundEnd, action: Action | None) -> tuple[int, str]:
    if action is not None:
        return action.status, action.reason
    if end.kind == "done":
        return autoresume.EXIT_DONE, end.reason
    if end.kind == "verdict":
        return end.status, end.reason
    return job_status(end.returncodes), end.reason


def _finish(args: argparse.Namespace, status: int, reason: str) -> int:
    """Log why the job ends, write or remove the autoresume flag, return ``status``."""
    attempt = args.attempt
    flagged = autoresume.settle(
        args.autoresume_file,
        status=status,
        reason=reason,
        attempt=attempt,
        max_retries=args.num_job_retries_on_failure,
    )
    what = {
        0: "finished",
        EXIT_USAGE: "configuration error (not requeued)",
        17: "failed validation (not requeued)",
        autoresume.EXIT_APPLICATION: "application fault (not requeued)",
        75: "requeue",
    }.get(status, "failed")
    # A clean finish says nothing: the job's own output ends the story (each recovery action
    # was logged when it happened). Nor does status 2: the script's usage error is the one
    # line that says why (train.py prints it once per node).
    journal.record("launcher_exit", status=status, reason=reason, requeue_flag=flagged, why=what)
    log.log(
        logging.DEBUG if status in (0, EXIT_USAGE) else logging.WARNING,
        "exit %d (%s): %s%s",
        status,
        what,
        reason,
        f"; autoresume flag written to {args.autoresume_file} (attempt {attempt}, "
        f"--num-job-retries-on-failure {args.num_job_retries_on_failure})"
        if flagged
        else "",
    )
    return status


def _log_to_stdout(node_rank: int) -> None:
    """The launcher is a program: its lifecycle lines go to stdout, next to the ranks' output."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[launcher node {node_rank}] %(message)s"))
    # The launcher's modules (inprocess.launch.*, its fault drill included) log through it.
    logger = logging.getLogger("restartable.inprocess.launch")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
