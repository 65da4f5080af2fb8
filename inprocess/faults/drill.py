"""Fault drills (Megatron-Bridge ``FaultToleranceConfig``'s ``simulate_fault`` names): kill or
hang one rank process once per job, to rehearse the recovery levels.

Two owners, same drill: the launcher's (``--simulated-fault-type``: ``FaultDrill`` signals a
child of its node) and the config's (``RestartConfig.simulate_fault``: ``RankDrill``, started by
``@restartable`` in every rank; only the drawn rank signals itself).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
from typing import TYPE_CHECKING

from checkpoint.sealing import parse_count
from inprocess import journal
from inprocess.config import SIMULATED_FAULT_TYPES, RestartConfig
from inprocess.protocol import job_keys, keys

if TYPE_CHECKING:
    from inprocess.launch.supervisor import NodeSupervisor
    from inprocess.protocol.environment import LaunchEnv
    from inprocess.protocol.store import Store

log = logging.getLogger(__name__)

FAULT_TYPES = SIMULATED_FAULT_TYPES
_START_WAIT_S = 600.0  # the longest wait for the job to start before the drill gives up
# Every rank of the job agrees on a drawn target through this key (first writer wins).
TARGET_KEY = keys.ROOT + "drill/rank"


def _signal_of(kind: str) -> signal.Signals:
    # rank_hung freezes the whole process (its heartbeat thread included): only the hard
    # timeout's kill ends it, as with a rank stuck in a C call holding the GIL.
    return signal.SIGKILL if kind == "rank_killed" else signal.SIGSTOP


class FaultDrill:
    """The launcher's drill, owned for the first round (``close()`` cancels it).

    A daemon thread waits until the ranks passed their initial barrier (the job runs), then
    ``base_delay`` plus up to as much again at random, then sends SIGKILL (``rank_killed``) or
    SIGSTOP (``rank_hung``: only the hard timeout can end it) to ``rank`` (random when None)
    if that rank lives on this node. ``kind="random"`` picks one of the two.
    """

    def __init__(
        self, sup: NodeSupervisor, *, kind: str, rank: int | None, base_delay: float
    ) -> None:
        if kind not in FAULT_TYPES:
            raise ValueError(f"kind ({kind!r}) must be one of {FAULT_TYPES}")
        cfg = sup.cfg
        self._sup = sup
        self._rank = random.randrange(cfg.world_size) if rank is None else rank
        self._kind = random.choice(("rank_killed", "rank_hung")) if kind == "random" else kind
        self._delay = base_delay * (1 + random.random())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-drill", daemon=True)
        if self._rank // cfg.nproc_per_node == cfg.node_rank:  # else another launcher's drill
            self._thread.start()

    def close(self) -> None:
        """Cancel the drill if it has not fired (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(1.0)

    def _run(self) -> None:
        sup = self._sup
        waited = 0.0
        while job_keys.job_state(sup.store) == job_keys.JOB_NOT_STARTED:
            if self._stop.wait(0.05) or waited > _START_WAIT_S:
                return
            waited += 0.05
        if self._stop.wait(self._delay):
            return
        local = self._rank % sup.cfg.nproc_per_node
        child = next(
            (c for c in list(sup.children.values()) if c.slot == local and c.generation == 0),
            None,
        )
        if child is None or child.proc.poll() is not None:
            return
        log.warning(
            "fault drill: %s on rank %d (pid %d) after %.1f s", self._kind, self._rank,
            child.proc.pid, self._delay,
        )  # fmt: skip
        os.kill(child.proc.pid, _signal_of(self._kind))


class RankDrill:
    """The config's drill in one rank process (``close()`` cancels it; idempotent).

    Built by ``start_in_rank`` after the initial barrier. When this process is the target, a
    daemon thread waits ``delay`` seconds, writes a ``fault_fired`` journal record (the
    downtime report names the window ``drill:<kind>@rank<R>``), and signals its own process.
    """

    def __init__(self, *, kind: str, rank: int, delay: float) -> None:
        self.kind, self.rank, self.delay = kind, rank, delay
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-drill", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Cancel the drill if it has not fired (the job ended first)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(1.0)

    def _run(self) -> None:
        if self._stop.wait(self.delay):
            return
        log.warning(
            "fault drill (simulate_fault): %s on rank %d (pid %d) after %.1f s",
            self.kind, self.rank, os.getpid(), self.delay,
        )  # fmt: skip
        journal.record(
            "fault_fired", kind=self.kind, fault=f"drill:{self.kind}@rank{self.rank}", step=None
        )
        os.kill(os.getpid(), _signal_of(self.kind))


def start_in_rank(
    cfg: RestartConfig,
    env: LaunchEnv,
    store: Store,
    *,
    rng: random.Random | None = None,
) -> RankDrill | None:
    """Called once per job by every rank right after the initial barrier: the config's drill,
    or None (no drill, a respawned process, a later round of an in-job or torchrun restart:
    ``env.launch_round`` > 0, or this rank is not the target).

    With ``simulated_fault_rank`` None every rank proposes a random RANK and the first proposal
    stored wins (``TARGET_KEY``), so exactly one rank fires; never blocks beyond one store
    round trip.
    """
    if not cfg.simulate_fault or env.respawn_generation > 0 or env.launch_round > 0:
        return None
    rng = rng or random.Random()
    target = cfg.simulated_fault_rank
    if target is None:
        proposal = str(rng.randrange(env.world_size))
        store.compare_set(TARGET_KEY, "", proposal)
        target = parse_count(TARGET_KEY, store.get(TARGET_KEY))
    if target != env.rank:
        return None
    kind = cfg.simulated_fault_type
    if kind == "random":
        kind = rng.choice(("rank_killed", "rank_hung"))
    delay = cfg.simulated_fault_base_delay * (1 + rng.random())
    reserves = env.world_size - (cfg.active_world_size or env.world_size)
    if reserves <= 0 and env.max_respawns == 0:  # both kinds lose the rank (killed, hung)
        log.warning(
            "fault drill: %s on rank %d with no warm reserve and respawn off: the job will "
            "shrink to %d ranks (keep a reserve with active_world_size, or launch with "
            "--max-respawns 1)",
            kind,
            target,
            env.world_size - 1,
        )
    return RankDrill(kind=kind, rank=target, delay=delay)
