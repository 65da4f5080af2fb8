"""A respawned process's way into the job: register as a joiner, wait for the decision that
admits it (docs/launching.md: respawn).

Called by the restart loop (``inprocess.restart.loop``) on the main thread of a process the
launcher respawned: ``register`` once its watchdog runs, then ``admit``, which blocks until a
restart decision admits it or the job ends.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from restartable.inprocess.config import RestartConfig
from restartable.inprocess.protocol import job_keys
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.restart.agreement import RestartAgreement

if TYPE_CHECKING:  # imported at run time by startup.new_watchdog only (see there)
    from restartable.inprocess.watchdog_owner import Watchdog

log = logging.getLogger(__name__)


def register(store: Store, watchdog: Watchdog, *, me: int) -> int:
    """Start ``watchdog`` parked and register this process as a joiner; returns the iteration
    announced when it registered (``admit``'s ``since``)."""
    # Watched from now on, so that it is a ready reserve the moment it registers; until
    # it is admitted its death is reported for an iteration nobody waits on, which only
    # marks it gone (it must not interrupt the ranks that train).
    watchdog.set_iteration(job_keys.PARKED_ITERATION)
    watchdog.start()
    # Read before registering: the decision that admits this process can only come
    # after it registered, so it is one of this iteration's or a later one's. Read
    # after, it could already be past (the decision taken and the next iteration
    # announced meanwhile), and the wait below would never see its admission.
    registered_at = job_keys.current_iteration(store)
    job_keys.register_joiner(store, me)
    return registered_at


def admit(
    store: Store,
    watchdog: Watchdog,
    agreement: RestartAgreement,
    cfg: RestartConfig,
    *,
    me: int,
    slot: int,
    since: int,
) -> job_keys.Admission | None:
    """Wait for a restart decision that admits this process to the reserve pool, and take over
    the decisions' history (every rank decides from the same one). None: the job finished
    before it needed this process."""
    admitted = job_keys.wait_admission(
        store, identity=me, decision_timeout=cfg.barrier_timeout, since=since
    )
    if admitted is None:
        log.info("respawned rank %d: the job finished before it was needed", me)
        return None
    agreement.adopt(admitted.decisions)
    watchdog.set_iteration(admitted.iteration)
    role = "active" if admitted.assignment.rank_of(me) is not None else "reserve"
    log.info(
        "respawned rank %d (slot %d) admitted as %s from iteration %d",
        me,
        slot,
        role,
        admitted.iteration,
    )
    return admitted
