"""A rank's goodbye at the end of ``@restartable``: close its owners, mark it left in the
store, and close the clients that hold connections.

Called once by the restart loop's ``close()`` (``inprocess.restart.loop``), on the main thread,
after every thread that uses the store was closed. Never raises for the store's sake.
"""

from __future__ import annotations

import logging
from typing import Any

from restartable.inprocess.protocol import keys
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.store_server import mark_left

log = logging.getLogger(__name__)


def leave_store(
    store: Store, *, me: int, world_size: int, owns_cleanup: bool, close: tuple[Any, ...]
) -> None:
    """Mark ``me`` as left; the last rank out deletes the job's keys where ``owns_cleanup``.
    Then close each store of ``close`` (None entries skipped)."""
    try:
        left = mark_left(store, me)
        if owns_cleanup and left + len(keys.gone_ranks(store)) >= world_size:
            # The last rank out of a job without a launcher (the others left or
            # died): nobody reads the job's keys any more. A TCPStore's keys go with
            # its server; inprocess.launch deletes the keys when the whole job is over.
            store.delete_all()
            log.info("rank %d: last to leave; deleted the job's keys", me)
    except Exception as exc:
        log.debug("could not mark this rank as left: %r", exc)
    for s in close:
        if s is not None:
            s.close()


def close_quietly(*owners: Any) -> None:
    """Close each owner (None entries skipped) in order; a failing ``close()`` is logged as a
    WARNING and does not keep the next owner open."""
    for owner in owners:
        if owner is not None:
            try:
                owner.close()
            except Exception as exc:
                log.warning("closing %s failed: %r", type(owner).__name__, exc)
