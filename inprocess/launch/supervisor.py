"""One node's rank processes for one round of the job: start them, respawn the ones that die, and
say how the round ended (done, a verdict, or the in-process path gave up).

Owned by ``inprocess.launch`` (one ``NodeSupervisor`` per round, closed before the next). The
launcher's main thread runs ``run()``; each child has one daemon thread relaying its output.
Every wait is bounded by ``monitor_interval`` (the polling cadence) or ``stop_grace``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Protocol

from restartable.checkpoint.sealing import ForgedValueError
from restartable.inprocess import journal
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.launch.autoresume import VERDICT_STATUSES
from restartable.inprocess.launch.pool import PooledProcess, WarmPool
from restartable.inprocess.launch.respawn import Death, Slot, schedule_respawn
from restartable.inprocess.protocol import job_keys
from restartable.inprocess.protocol.ranks import respawn_identity
from restartable.inprocess.protocol.store import Store

log = logging.getLogger(__name__)

# How long a due respawn waits for a warm pool that is still importing before it starts cold;
# well inside respawn_wait_timeout (default 10 s), which a restart short of ranks waits for it.
POOL_WARMING_WAIT_S = 5.0


@dataclass(frozen=True)
class SupervisorConfig:
    """What the launcher's flags say about one node's processes."""

    script: Sequence[str]  # argv after the interpreter
    node_rank: int
    nproc_per_node: int
    world_size: int
    master_addr: str
    max_respawns: int  # per slot and round
    respawn_backoff: float  # seconds; doubled per consecutive start-up death of a slot
    monitor_interval: float
    stop_grace: float  # SIGTERM -> SIGKILL when the launcher stops its ranks


@dataclass(frozen=True)
class RoundEnd:
    """How a round ended on this node.

    ``kind``: "done" (the job finished), "verdict" (a rank exited with a status that speaks for
    the job: ``VERDICT_STATUSES``), "stopped" (the in-process path gave up, or every rank of the
    job is gone: the launcher restarts the job or asks for a requeue), "plain" (a job without
    ``@restartable``: ``status`` from the ranks' exit codes), "interrupted" (the launcher was
    signalled), "action" (another launcher decided; see ``JobControl``).
    """

    kind: str
    reason: str
    returncodes: tuple[int, ...] = ()
    status: int = 0
    at: float = 0.0  # when this node saw the end (the clock's wall time)


class RoundLink(Protocol):
    """The supervisor's one collaborator: the rest of the job as this node's round sees it (the
    other launchers, the journal, the ranks' environment). Called from ``run()``'s thread only;
    ``poll_action``, ``report_live`` and ``job_gone`` may raise the launcher's ``NodeLostError``,
    which ends ``run()``."""

    def env_of(self, local: int, generation: int) -> Mapping[str, str]:
        """The environment of the ``generation``-th process of slot ``local``."""
        ...

    def poll_action(self) -> str | None:
        """Why another launcher ended the round (checked each look), or None."""
        ...

    def on_stopped(self, reason: str) -> None:
        """The in-process path stopped (called once per round)."""
        ...

    def report_live(self, n: int) -> None:
        """This node still runs (or will respawn) ``n`` processes."""
        ...

    def job_gone(self) -> bool:
        """Every node reported no process left."""
        ...

    def on_tick(self) -> None:
        """Each look, before the children's exits."""
        ...


@dataclass
class _Child:
    slot: int  # local rank
    generation: int
    identity: int
    proc: subprocess.Popen[bytes] | PooledProcess
    started: float
    pump: threading.Thread


@dataclass
class NodeSupervisor:
    """The processes of one node in one round (close() it; it is a context manager).

    ``store``: a client of the round's store (``job_state``, ``mark_gone``); ``link``: the rest
    of the job (``RoundLink``: the processes' environment, another launcher's decision, checked
    every ``monitor_interval``, the in-process path's stop); ``out`` where prefixed output lines
    go; ``clock``: where the waits and the round's end time come from.
    """

    cfg: SupervisorConfig
    store: Store
    link: RoundLink
    out: IO[bytes]
    # Respawns (and, with warm_initial, the round's first processes: an in-job restart) are
    # forked from it while it is ready; otherwise, or when it broke, started cold.
    pool: WarmPool | None = None
    warm_initial: bool = False
    clock: Clock = SYSTEM
    lock: threading.Lock = field(default_factory=threading.Lock)
    children: dict[int, _Child] = field(default_factory=dict)
    slots: dict[int, Slot] = field(default_factory=dict)
    exits: list[tuple[int, int]] = field(default_factory=list)  # (identity, returncode)
    interrupted: bool = False
    closed: bool = False

    # ----- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> NodeSupervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every child still running (SIGTERM, ``stop_grace``, SIGKILL); idempotent."""
        if self.closed:
            return
        self.closed = True
        self.stop_children()

    def signal_children(self, sig: int) -> None:
        """Forward ``sig`` to every live child (the launcher's SIGINT / SIGTERM handler)."""
        self.interrupted = True
        for c in list(self.children.values()):
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.proc.pid, sig)

    def stop_children(self, patience: float | None = None) -> None:
        """End every live child: ``patience`` seconds (default ``stop_grace``) to exit on its
        own (after the in-process path stopped, every rank is already leaving and its last words
        are the error that says why), then SIGTERM, ``stop_grace`` more, then SIGKILL."""
        clock = self.clock
        patience = clock.monotonic() + (self.cfg.stop_grace if patience is None else patience)
        while clock.monotonic() < patience and any(
            c.proc.poll() is None for c in self.children.values()
        ):
            clock.sleep(0.01)
        live = [c for c in self.children.values() if c.proc.poll() is None]
        for c in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.proc.pid, signal.SIGTERM)
        deadline = clock.monotonic() + self.cfg.stop_grace
        for c in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(max(0.0, deadline - clock.monotonic()))
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        for c in self.children.values():
            c.pump.join(5.0)

    # ----- the round -------------------------------------------------------------------------

    def run(self) -> RoundEnd:
        """Start the node's ranks and supervise them until the round ends (see ``RoundEnd``)."""
        for local in range(self.cfg.nproc_per_node):
            self.slots[local] = Slot()
            self._spawn(local, 0)
        stopped_told = False
        while True:
            self.clock.sleep(self.cfg.monitor_interval)
            self.link.on_tick()
            self._reap()
            state, why = self._look()
            action = self.link.poll_action()
            if action is not None:
                return self._end("action", action)
            if state == job_keys.JOB_STOPPED and not stopped_told:
                stopped_told = True
                self.link.on_stopped(why or "the in-process restart gave up: stopped")
                continue
            self._respawn_due(state)
            live = sum(c.proc.poll() is None for c in self.children.values())
            pending = sum(s.due is not None for s in self.slots.values())
            self.link.report_live(live + pending)
            if live + pending:
                continue
            end = self._end_of_round(state)
            if end is not None:
                return end
            if not stopped_told and self.link.job_gone():
                stopped_told = True
                self.link.on_stopped("every rank of the job is gone")

    def _look(self) -> tuple[str, str | None]:
        """The job's state (``job_keys.job_state``) and, when stopped, why in one line.

        A value that fails to verify at any key read here stops the job like the in-process
        path giving up, the reason naming the key: a decision (restart or status 75), never an
        exception out of the launcher (found by issue 46: a raw ``restartable/stopped`` ended
        the launcher with a traceback and status 1)."""
        try:
            state = job_keys.job_state(self.store)
            if state != job_keys.JOB_STOPPED:
                return state, None
            reason = job_keys.stop_reason(self.store) or "stopped"
        except ForgedValueError as exc:
            return job_keys.JOB_STOPPED, f"the job's control store cannot be trusted: {exc}"
        except Exception as exc:  # the store host (node 0) is gone: poll_action() says so
            log.debug("job state unreadable: %r", exc)
            return job_keys.JOB_RUNNING, None
        return state, f"the in-process restart gave up: {reason.splitlines()[0]}"

    def _end_of_round(self, state: str) -> RoundEnd | None:
        """No child of this node is left: how the round ended, or None to keep waiting (the
        job goes on on other nodes)."""
        verdict = next((rc for _, rc in self.exits if rc in VERDICT_STATUSES), None)
        if self.interrupted:
            return self._end("interrupted", "the launcher was signalled")
        if verdict is not None:
            return self._end("verdict", f"a rank exited with status {verdict}", verdict)
        if state == job_keys.JOB_DONE:
            return self._end("done", "the job finished")
        if state == job_keys.JOB_NOT_STARTED:
            return self._end("plain", "every rank exited")
        return None

    def _end(self, kind: str, reason: str, status: int = 0) -> RoundEnd:
        codes = tuple(rc for _, rc in self.exits)
        return RoundEnd(kind, reason, codes, status, at=self.clock.wall())

    # ----- children --------------------------------------------------------------------------

    def _spawn(self, local: int, generation: int) -> None:
        cfg = self.cfg
        slot_rank = cfg.node_rank * cfg.nproc_per_node + local
        identity = respawn_identity(slot_rank, generation, world_size=cfg.world_size)
        proc = self._start_process(local, generation)
        assert proc.stdout is not None
        prefix = f"[rank {slot_rank}] " if generation == 0 else f"[rank {slot_rank}.{generation}] "
        pump = threading.Thread(
            target=_pump, args=(proc.stdout, prefix.encode(), self.out, self.lock), daemon=True
        )
        pump.start()
        self.children[identity] = _Child(
            local, generation, identity, proc, self.clock.monotonic(), pump
        )
        if generation:
            # The start of a respawn's last stage (the report's "join": until it is a reserve).
            replaces = respawn_identity(slot_rank, generation - 1, world_size=cfg.world_size)
            journal.record(
                "respawn_started",
                slot_rank=slot_rank,
                identity=identity,
                replaces=replaces,
                generation=generation,
                proc_pid=proc.pid,
            )

    def _start_process(
        self, local: int, generation: int
    ) -> subprocess.Popen[bytes] | PooledProcess:
        """Fork the process from the warm pool when it may (see ``pool``), else start it cold."""
        env = dict(self.link.env_of(local, generation))
        if self.pool is not None and (generation or self.warm_initial):
            warm = self.pool.spawn(self.cfg.script, env=env)
            if warm is not None:
                log.info(
                    "rank process of slot %d forked from the warm pool (pid %d)", local, warm.pid
                )
                return warm
        return subprocess.Popen(
            # The entry takes the job's secret out of the environment before the script runs.
            [sys.executable, "-m", "restartable.inprocess.rank_entry", *self.cfg.script],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C reaches ranks only through us
        )

    def _reap(self) -> None:
        """Handle children that exited since the last look: schedule a respawn or retire."""
        for identity, c in list(self.children.items()):
            rc = c.proc.poll()
            if rc is None or any(i == identity for i, _ in self.exits):
                continue
            self.exits.append((identity, rc))
            lived = self.clock.monotonic() - c.started
            if rc == 0 or self.interrupted:
                continue
            state = self._look()[0]
            if state == job_keys.JOB_NOT_STARTED:
                continue  # not a @restartable job (or not started yet): nothing to join
            # Peers learn of the death from its watchdog; a respawned process not yet admitted
            # has none, and must not be counted on by the next restart decision.
            try:
                job_keys.mark_gone(self.store, identity)
                # Died at start-up: before it could take part (a respawned process registers
                # once ready). Repeated, it means a bad environment: back off, no fork storm.
                joined = c.generation == 0 or identity in job_keys.registered_joiners(self.store)
            except Exception as exc:  # node 0 (the store) is gone: poll_action() says so
                log.debug("store unreachable while reaping identity %d: %r", identity, exc)
                continue
            if rc in VERDICT_STATUSES or state in (job_keys.JOB_DONE, job_keys.JOB_STOPPED):
                continue
            cfg = self.cfg
            rank = cfg.node_rank * cfg.nproc_per_node + c.slot
            death = Death(rank, c.identity, c.proc.pid, rc, lived, at_startup=not joined)
            schedule_respawn(
                self.slots[c.slot],
                death,
                max_respawns=cfg.max_respawns,
                backoff=cfg.respawn_backoff,
                world_size=cfg.world_size,
                store=self.store,
                clock=self.clock,
            )

    def _respawn_due(self, state: str) -> None:
        now = self.clock.monotonic()
        # A pool still importing (inprocess.forkserver: ready once a first DDP's imports are
        # done) is worth a short wait: a cold start pays the interpreter, torch and those
        # imports again, at full priority beside the training ranks.
        warming = self.pool is not None and self.pool.warming()
        for local, slot in self.slots.items():
            if slot.due is None or slot.due > now:
                continue
            if warming and now < slot.due + POOL_WARMING_WAIT_S:
                continue
            slot.due = None
            if state != job_keys.JOB_RUNNING or self.interrupted:
                continue  # the job ended meanwhile: nobody to join
            slot.respawns += 1
            self._spawn(local, slot.respawns)


def kill_children(sup: NodeSupervisor) -> None:
    """SIGKILL every live child of ``sup`` at once and reap it: the job's store is gone, so
    nothing a rank could still do (a save, its last words) can succeed; left to notice it
    themselves, they would only print tracebacks of the lost connection."""
    for c in sup.children.values():
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()
    for c in sup.children.values():
        c.pump.join(5.0)


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()
