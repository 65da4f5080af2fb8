"""The launcher's fault drill (``--simulated-fault-type``, Megatron-Bridge's
``FaultToleranceConfig`` names): kill or hang one rank process of the first round, once per
job, to rehearse the recovery levels. The ranks' own drill (``RestartConfig.simulate_fault``)
is ``inprocess.faults.drill``, whose kinds and signals this one shares.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from typing import TYPE_CHECKING

from restartable.inprocess.faults.drill import FAULT_TYPES, signal_of
from restartable.inprocess.protocol import job_keys

if TYPE_CHECKING:
    from restartable.inprocess.launch.supervisor import NodeSupervisor

# A child of "restartable.launch": its lines reach the launcher's stdout (cli._log_to_stdout).
log = logging.getLogger(__name__)

_START_WAIT_S = 600.0  # the longest wait for the job to start before the drill gives up


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
            "fault drill: %s on rank %d (pid %d) after %.1f s",
            self._kind,
            self._rank,
            child.proc.pid,
            self._delay,
        )
        os.kill(child.proc.pid, signal_of(self._kind))
