"""``python -m inprocess.launch``: start the ranks of one node, host the job's store, and recover
from lost processes, cheapest level first.

    python -m inprocess.launch --nproc-per-node 4 --max-respawns 2 --max-restarts 3 \
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

Recovery (for ``@restartable`` jobs; docs/launching.md): (2) respawn: a rank process that dies
(signal, crash) is replaced by a fresh one that joins the reserve pool (``--max-respawns`` per
slot, with backoff for start-up deaths); (3) in-job restart: when the in-process restart gives up,
every launcher restarts all its ranks, which resume from their newest checkpoint
(``--max-restarts``); (4) job retry: the job ends with status 75 and writes the
``--autoresume-file`` flag while ``--num-job-retries-on-failure`` allows.

Exit status (``inprocess.launch.autoresume``): 0 the job finished; 2 the job cannot start as
configured (a bad or unknown flag, a missing script, an unreachable store: one line, within
seconds, before any rank starts; or the script's own usage error); 17 a result failed
validation; 75 requeue (in-job restarts exhausted, a node lost, preempted). For a script without
``@restartable``: 0 when at least one rank exited 0 and no rank exited with a non-zero status of
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
from collections.abc import Mapping, Sequence
from types import FrameType

from checkpoint import sealing
from checkpoint.private_files import private_dir
from inprocess import journal
from inprocess.errors import ConfigError
from inprocess.etcd.errors import EtcdStoreError
from inprocess.faults.drill import FaultDrill
from inprocess.launch import autoresume, doors
from inprocess.launch.actions import Action, restart_or_end
from inprocess.launch.flags import parse_args as parse_args  # where tests and task.py look
from inprocess.launch.node_lost import NodeLostError
from inprocess.launch.pool import DEFAULT_PRELOAD, WarmPool
from inprocess.launch.rounds import JobControl
from inprocess.launch.supervisor import NodeSupervisor, RoundEnd, SupervisorConfig
from inprocess.protocol import environment, job_keys
from inprocess.protocol.store import Store
from inprocess.usage import EXIT_USAGE

log = logging.getLogger("inprocess.launch")


def rank_env(
    args: argparse.Namespace,
    local_rank: int,
    port: int,
    generation: int = 0,
    store_env: Mapping[str, str] | None = None,
    *,
    round_: int = 0,
    launch_id: str | None = None,
) -> dict[str, str]:
    """The environment of one rank (the launcher's own environment plus the job variables).

    ``generation`` > 0: a process respawned in the slot of ``local_rank``; it keeps the slot's
    RANK and joins the job under a new identity (``inprocess.protocol.ranks.respawn_identity``).
    ``store_env``: the round's key (RESTARTABLE_SECRET) and, with ``--store``, its
    INPROCESS_STORE / INPROCESS_JOB_ID.
    ``round_``: the in-job restart round (INPROCESS_LAUNCH_ROUND; the config's fault drill
    fires in round 0 only). ``launch_id``: RESTARTABLE_LAUNCH_ID, the same on every node and
    in every round (the journal groups a launch's records by it; the example names its
    directories after it).
    """
    n = args.nproc_per_node
    inherited = dict(os.environ)
    for name in ("INPROCESS_STORE", "INPROCESS_JOB_ID"):  # this round's values, or none
        inherited.pop(name, None)
    env = {
        **torchrun_defaults(n, inherited),
        **inherited,
        **(store_env or {}),
        "RANK": str(args.node_rank * n + local_rank),
        "WORLD_SIZE": str(args.nnodes * n),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(n),
        "GROUP_RANK": str(args.node_rank),
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(port),
        "INPROCESS_STORE_HOSTED": "1",
        # The ranks die with us (the store we host dies with us too): see bind_to_launcher().
        "INPROCESS_LAUNCHER_PID": str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
        "INPROCESS_LAUNCH_ROUND": str(round_),
        # So a script can tell whether a lost rank comes back (e.g. the example's warning
        # when its fault plan loses more ranks than it has reserves).
        "INPROCESS_MAX_RESPAWNS": str(getattr(args, "max_respawns", 0)),
        environment.ENV_ATTEMPT: str(getattr(args, "attempt", 0)),
        **_torchrun_names(args, args.node_rank * n + local_rank, round_),
    }
    if launch_id is not None:
        env[journal.ENV_LAUNCH] = launch_id
    if generation:
        env["INPROCESS_RESPAWN_GENERATION"] = str(generation)
    else:
        env.pop("INPROCESS_RESPAWN_GENERATION", None)
    return env


def _torchrun_names(args: argparse.Namespace, rank: int, round_: int) -> dict[str, str]:
    """torchrun's names for the facts ``rank_env`` sets, for scripts and libraries that read
    them."""
    return {
        "GROUP_WORLD_SIZE": str(args.nnodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(args.nnodes * args.nproc_per_node),
        "TORCHELASTIC_RESTART_COUNT": str(round_),
        "TORCHELASTIC_MAX_RESTARTS": str(args.max_restarts),
        # A store server listens at MASTER_ADDR:MASTER_PORT (ours, as torchrun's agent store):
        # a script's own init_process_group("env://") connects to it instead of binding
        # MASTER_PORT on rank 0 (EADDRINUSE there, and the other ranks waited for rank 0 until
        # the init timeout); @restartable then names the misuse (inprocess.restart.loop).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def torchrun_defaults(nproc_per_node: int, environ: Mapping[str, str]) -> dict[str, str]:
    """What torchrun sets unless the user did: ``OMP_NUM_THREADS=1`` with several ranks per
    node (each rank's intra-op pool would otherwise take every core: measured, nanoGPT's step
    took 3x as long), ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``. A value in ``environ`` wins."""
    defaults = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if nproc_per_node > 1:
        defaults["OMP_NUM_THREADS"] = "1"
    return {k: v for k, v in defaults.items() if k not in environ}


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
    jr = _LauncherJournal(args.node_rank)
    try:
        return _main(args, jr)
    finally:
        jr.close()


class _LauncherJournal:
    """The launcher's part of the run journal (respawns, in-job restarts, the exit); its file is
    rank-1-... for node 0, rank-2-... for node 1, ...

    In ``$RESTARTABLE_JOURNAL_DIR`` when the environment names one; otherwise in the directory
    the ranks journal to (``RestartConfig.journal_dir``), once they published it in the round's
    store (``job_keys.publish_journal_dir``): a record before that is not kept.
    """

    def __init__(self, node_rank: int) -> None:
        self.rank = -1 - node_rank
        self.launch: str | None = None
        self.jr: journal.Journal | None = None

    def unusable(self) -> str | None:
        """Why the environment's journal directory may not be used (another user owns it or may
        write it: docs/security.md), or None."""
        directory = journal.resolve_dir(None)
        try:
            if directory is not None:
                private_dir(directory, what=journal.ENV_DIR)
        except OSError as exc:
            return str(exc)
        return None

    def start(self, launch: str) -> None:
        """The launch id is known (``JobControl``): open the environment's directory, if any."""
        self.launch = launch
        directory = journal.resolve_dir(None)
        if directory is not None:
            self.jr = journal.open_journal(directory, rank=self.rank, launch=launch)

    def follow(self, store: Store | None) -> None:
        """Open the ranks' directory once they published it (one store look per call until)."""
        if self.jr is not None or store is None or self.launch is None:
            return
        try:
            directory = job_keys.journal_dir(store)
        except Exception as exc:  # the store is gone: the round ends through poll_action
            log.debug("journal directory unreadable: %r", exc)
            return
        if directory is None:
            return
        try:
            self.jr = journal.open_journal(directory, rank=self.rank, launch=self.launch)
        except ValueError as exc:  # not writable from here: the ranks' journals go on alone
            log.warning("the launcher keeps no journal: %s", exc)
            self.launch = None  # stop looking

    def close(self) -> None:
        if self.jr is not None:
            self.jr.close()
            self.jr = None


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


def _main(args: argparse.Namespace, jr: _LauncherJournal) -> int:
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
    args: argparse.Namespace, control: JobControl, jr: _LauncherJournal, pool: WarmPool | None
) -> int:
    """The job's rounds on this node until it ends; the launcher's exit status."""
    current: list[NodeSupervisor] = []
    signals_seen = 0

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal signals_seen
        signals_seen += 1
        for sup in current:
            sup.signal_children(signum if signals_seen == 1 else signal.SIGKILL)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        k = 0
        while True:
            end, action = _run_round(args, control, k, current, jr, pool)
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
            status, reason = _status(end, action)
            control.publish_end(status)
            control.leave()  # with etcd, the last launcher out deletes the job's keys
            return _finish(args, status, reason)
    except NodeLostError as exc:
        return _finish(args, autoresume.EXIT_REQUEUE, str(exc))
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


def _supervisor_config(args: argparse.Namespace) -> SupervisorConfig:
    """What the launcher's flags say about this node's processes."""
    return SupervisorConfig(
        script=[args.script, *args.args],
        node_rank=args.node_rank,
        nproc_per_node=args.nproc_per_node,
        world_size=args.nnodes * args.nproc_per_node,
        master_addr=args.master_addr,
        max_respawns=args.max_respawns,
        respawn_backoff=args.respawn_backoff,
        monitor_interval=args.monitor_interval,
        stop_grace=args.stop_grace,
    )


def _run_round(
    args: argparse.Namespace,
    control: JobControl,
    k: int,
    current: list[NodeSupervisor],
    jr: _LauncherJournal,
    pool: WarmPool | None = None,
) -> tuple[RoundEnd, Action | None]:
    """One round on this node: start the ranks, supervise them, stop them; the round's end and
    the action (restart or end) every node agreed on, if any."""
    port, store = control.open_round(k)
    launch_id = control.launch_id
    cfg = _supervisor_config(args)

    def on_stopped(reason: str) -> None:
        origin = job_keys.stop_origin(store) if store is not None else ""
        control.request(
            k, restart_or_end(k, max_restarts=args.max_restarts, reason=reason, origin=origin)
        )

    def poll_action() -> str | None:
        a = control.action(k)
        return None if a is None else a.reason

    sup = NodeSupervisor(
        cfg=cfg,
        store=store,
        env_of=lambda local, gen: rank_env(
            args, local, port, gen, control.round_store_env(k), round_=k, launch_id=launch_id
        ),
        out=sys.stdout.buffer,
        poll_action=poll_action,
        on_stopped=on_stopped,
        report_live=lambda n: control.report_live(k, n),
        job_gone=lambda: control.job_gone(k),
        on_tick=lambda: jr.follow(store),
        pool=pool,
        warm_initial=k > 0,  # an in-job restart forks every rank from the pool
    )
    current[:] = [sup]
    drill = None
    if k == 0 and args.simulated_fault_type is not None:
        drill = FaultDrill(
            sup,
            kind=args.simulated_fault_type,
            rank=args.simulated_fault_rank,
            base_delay=args.simulated_fault_base_delay,
        )
    try:
        end = sup.run()
        action = control.action(k) if end.kind == "action" else None
        if action is not None and action.kind == "restart":
            # The launcher already logs why; every second the old ranks take to leave on their
            # own is downtime, so they get SIGTERM at once (then --stop-grace, then SIGKILL).
            sup.stop_children(patience=0.0)
    finally:
        sup.close()  # ends what still runs (an action from another node, or a failure here)
        if drill is not None:
            drill.close()
    return end, action


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
    for name in ("inprocess.launch", "inprocess.launch.supervisor", "inprocess.launch.rounds",
                 "inprocess.launch.pool", "inprocess.faults.drill"):  # fmt: skip
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
