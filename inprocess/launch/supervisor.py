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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from checkpoint.sealing import ForgedValueError
from inprocess import journal
from inprocess.launch.autoresume import VERDICT_STATUSES
from inprocess.launch.pool import PooledProcess, WarmPool
from inprocess.protocol import job_keys
from inprocess.protocol.ranks import respawn_identity
from inprocess.protocol.store import Store

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 60.0  # the longest wait before respawning a crash-looping slot


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
    at: float = field(default_factory=time.time)  # when this node saw the end (time.time())


@dataclass
class _Child:
    slot: int  # local rank
    generation: int
    identity: int
    proc: subprocess.Popen[bytes] | PooledProcess
    started: float
    pump: threading.Thread


@dataclass
class _Slot:
    respawns: int = 0
    short_deaths: int = 0  # consecutive deaths before it registered
    due: float | None = None  # monotonic time of a scheduled respawn
    retired: str | None = None


@dataclass
class NodeSupervisor:
    """The processes of one node in one round (close() it; it is a context manager).

    ``store``: a client of the round's store (``job_state``, ``mark_gone``); ``env_of(local,
    generation)`` the environment of a process; ``out`` where prefixed output lines go;
    ``poll_action()`` returns a decision another launcher published (or None), checked every
    ``monitor_interval``; ``on_stopped(reason)`` is called once when the in-process path stopped.
    """

    cfg: SupervisorConfig
    store: Store
    env_of: Callable[[int, int], Mapping[str, str]]
    out: IO[bytes]
    poll_action: Callable[[], str | None]
    on_stopped: Callable[[str], None]
    report_live: Callable[[int], None] = lambda n: None
    job_gone: Callable[[], bool] = lambda: False
    on_tick: Callable[[], None] = lambda: None  # each look, before the children's exits
    # Respawns (and, with warm_initial, the round's first processes: an in-job restart) are
    # forked from it while it is ready; otherwise, or when it broke, started cold.
    pool: WarmPool | None = None
    warm_initial: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    children: dict[int, _Child] = field(default_factory=dict)
    slots: dict[int, _Slot] = field(default_factory=dict)
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
        patience = time.monotonic() + (self.cfg.stop_grace if patience is None else patience)
        while time.monotonic() < patience and any(
            c.proc.poll() is None for c in self.children.values()
        ):
            time.sleep(0.01)
        live = [c for c in self.children.values() if c.proc.poll() is None]
        for c in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_grace
        for c in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        for c in self.children.values():
            c.pump.join(5.0)

    # ----- the round -------------------------------------------------------------------------

    def run(self) -> RoundEnd:
        """Start the node's ranks and supervise them until the round ends (see ``RoundEnd``)."""
        for local in range(self.cfg.nproc_per_node):
            self.slots[local] = _Slot()
            self._spawn(local, 0)
        stopped_told = False
        while True:
            time.sleep(self.cfg.monitor_interval)
            self.on_tick()
            self._reap()
            state, why = self._look()
            action = self.poll_action()
            if action is not None:
                return RoundEnd("action", action, self._codes())
            if state == job_keys.JOB_STOPPED and not stopped_told:
                stopped_told = True
                self.on_stopped(why or "the in-process restart gave up: stopped")
                continue
            self._respawn_due(state)
            live = sum(c.proc.poll() is None for c in self.children.values())
            pending = sum(s.due is not None for s in self.slots.values())
            self.report_live(live + pending)
            if live + pending:
                continue
            end = self._end_of_round(state)
            if end is not None:
                return end
            if not stopped_told and self.job_gone():
                stopped_told = True
                self.on_stopped("every rank of the job is gone")

    def _look(self) -> tuple[str, str | None]:
        """The job's state (``job_keys.job_state``) and, when stopped, why in one line.

        A value that fails to verify at any key read here stops the job like the in-process
        path giving up, the reason naming the key: a decision (restart or status 75), never an
        exception out of the launcher (found by issue 46: a raw ``restartable/stopped`` ended
        the launcher with a traceback and status 1)."""
        if self.store is None:
            return job_keys.JOB_NOT_STARTED, None
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
        codes = self._codes()
        verdict = next((rc for _, rc in self.exits if rc in VERDICT_STATUSES), None)
        if self.interrupted:
            return RoundEnd("interrupted", "the launcher was signalled", codes)
        if verdict is not None:
            return RoundEnd("verdict", f"a rank exited with status {verdict}", codes, verdict)
        if state == job_keys.JOB_DONE:
            return RoundEnd("done", "the job finished", codes)
        if state == job_keys.JOB_NOT_STARTED:
            return RoundEnd("plain", "every rank exited", codes)
        return None

    def _codes(self) -> tuple[int, ...]:
        return tuple(rc for _, rc in self.exits)

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
        self.children[identity] = _Child(local, generation, identity, proc, time.monotonic(), pump)
        if generation:
            # The start of a respawn's last stage (the report's "join": until it is a reserve).
            replaces = respawn_identity(slot_rank, generation - 1, world_size=cfg.world_size)
            journal.record(
                "respawn_started", slot_rank=slot_rank, identity=identity, replaces=replaces,
                generation=generation, proc_pid=proc.pid,
            )  # fmt: skip

    def _start_process(
        self, local: int, generation: int
    ) -> subprocess.Popen[bytes] | PooledProcess:
        """Fork the process from the warm pool when it may (see ``pool``), else start it cold."""
        env = dict(self.env_of(local, generation))
        if self.pool is not None and (generation or self.warm_initial):
            warm = self.pool.spawn(self.cfg.script, env=env)
            if warm is not None:
                log.info(
                    "rank process of slot %d forked from the warm pool (pid %d)", local, warm.pid
                )
                return warm
        return subprocess.Popen(
            # The entry takes the job's secret out of the environment before the script runs.
            [sys.executable, "-m", "inprocess.launch.entry", *self.cfg.script],
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
            lived = time.monotonic() - c.started
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
            self._schedule(c, rc, lived, at_startup=not joined)

    def _schedule(self, c: _Child, rc: int, lived: float, *, at_startup: bool) -> None:
        slot = self.slots[c.slot]
        cfg = self.cfg
        how = _describe_exit(rc)
        rank = cfg.node_rank * cfg.nproc_per_node + c.slot
        slot.short_deaths = slot.short_deaths + 1 if at_startup else 0
        if slot.respawns >= cfg.max_respawns:
            slot.retired = how
            log.warning(
                "respawn: slot of rank %d retired: its process (identity %d) %s after %.1f s and "
                "the slot was respawned %d time(s) already (--max-respawns %d); the job goes on "
                "without it%s",
                rank,
                c.identity,
                how,
                lived,
                slot.respawns,
                cfg.max_respawns,
                "" if cfg.max_respawns else " (respawn is off: --max-respawns 0)",
            )
            journal.record(
                "slot_retired", slot_rank=rank, identity=c.identity, how=how,
                proc_pid=c.proc.pid, lived_s=lived,
            )  # fmt: skip
            return
        # Announced before it starts: a restart decision short of ranks meanwhile waits for
        # it instead of shrinking or stopping the job (inprocess.protocol.capacity).
        identity = respawn_identity(rank, slot.respawns + 1, world_size=cfg.world_size)
        try:
            job_keys.announce_respawn(self.store, identity)
        except Exception as exc:  # node 0 (the store) is gone: poll_action() says so
            log.debug("store unreachable while announcing identity %d: %r", identity, exc)
        delay = 0.0
        if slot.short_deaths:  # it never got going: wait, longer each time in a row
            delay = min(_MAX_BACKOFF_S, cfg.respawn_backoff * 2 ** (slot.short_deaths - 1))
        slot.due = time.monotonic() + delay
        log.warning(
            "respawn: rank %d (identity %d) %s after %.1f s; a new process for its slot starts "
            "%s (respawn %d/%d of this slot)",
            rank,
            c.identity,
            how,
            lived,
            "now" if delay == 0 else f"in {delay:.1f} s (backoff: it died at start-up)",
            slot.respawns + 1,
            cfg.max_respawns,
        )
        journal.record(
            "respawn", slot_rank=rank, identity=c.identity, how=how, delay_s=delay,
            proc_pid=c.proc.pid, lived_s=lived,
        )  # fmt: skip

    def _respawn_due(self, state: str) -> None:
        now = time.monotonic()
        for local, slot in self.slots.items():
            if slot.due is None or slot.due > now:
                continue
            slot.due = None
            if state != job_keys.JOB_RUNNING or self.interrupted:
                continue  # the job ended meanwhile: nobody to join
            slot.respawns += 1
            self._spawn(local, slot.respawns)


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()
