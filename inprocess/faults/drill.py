"""The config's fault drill (Megatron-Bridge ``FaultToleranceConfig``'s ``simulate_fault``
names), in the rank processes: kill or hang one rank process once per job, to rehearse the
recovery levels.

``RestartConfig.simulate_fault``: ``RankDrill``, started by ``@restartable`` in every rank; only
the drawn rank signals itself. The launcher has the same drill (``--simulated-fault-type``:
``inprocess.launch.drill.FaultDrill`` signals a child of its node), with the kinds and signals
defined here.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
from typing import TYPE_CHECKING

from restartable.checkpoint.sealing import parse_count
from restartable.inprocess import journal
from restartable.inprocess.config import SIMULATED_FAULT_TYPES, RestartConfig
from restartable.inprocess.protocol import keys

if TYPE_CHECKING:
    from restartable.inprocess.protocol.environment import LaunchEnv
    from restartable.inprocess.protocol.store import Store

log = logging.getLogger(__name__)

FAULT_TYPES = SIMULATED_FAULT_TYPES
# Every rank of the job agrees on a drawn target through this key (first writer wins).
TARGET_KEY = keys.ROOT + "drill/rank"


def signal_of(kind: str) -> signal.Signals:
    """The signal of a drill ``kind`` ("rank_killed" or "rank_hung"; both drills send it)."""
    # rank_hung freezes the whole process (its heartbeat thread included): only the hard
    # timeout's kill ends it, as with a rank stuck in a C call holding the GIL.
    return signal.SIGKILL if kind == "rank_killed" else signal.SIGSTOP


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
            self.kind,
            self.rank,
            os.getpid(),
            self.delay,
        )
        journal.record(
            "fault_fired", kind=self.kind, fault=f"drill:{self.kind}@rank{self.rank}", step=None
        )
        os.kill(os.getpid(), signal_of(self.kind))


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
