"""One iteration of a warm reserve: warm up and prewarm once, then wait until the iteration ends.

Called by the restart loop (``inprocess.restart.loop``) on the main thread, once per iteration in
which this rank is a reserve. ``wait_as_reserve`` blocks until the iteration's outcome is
published (no timeout: the active ranks' barriers and watchdogs bound the iteration).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from restartable.inprocess.errors import RestartInterrupt
from restartable.inprocess.protocol import fault_records, iteration_end, keys
from restartable.inprocess.restart.active import Outcome
from restartable.inprocess.restart.interrupter import disarm
from restartable.inprocess.restart.services import RankServices
from restartable.inprocess.restart.warmup import FirstUseImports

log = logging.getLogger(__name__)


def wait_as_reserve(
    svc: RankServices,
    iteration: int,
    *,
    imports: FirstUseImports,
    prewarm: Callable[[], Any] | None,
) -> Outcome:
    """Start importing what a rank's first DDP / FSDP2 needs in the background (``imports``;
    once per process), run ``prewarm`` (None: not this iteration) once they are done, then
    wait for ``iteration``'s outcome."""
    imports.start()
    if prewarm is not None:
        imports.wait()  # the user's prewarm may import the same package: never both at once
        run_prewarm(svc, iteration, prewarm)
    with svc.progress.paused():
        result = iteration_end.wait_outcome(svc.store, iteration, timeout=None, clock=svc.clock)
    if result == keys.OUTCOME_DONE:
        return Outcome(done=True)
    return Outcome(done=False, noticed=svc.clock.wall())


def run_prewarm(svc: RankServices, iteration: int, prewarm: Callable[[], Any]) -> None:
    """Run the user's ``prewarm`` on this reserve, interrupted if the iteration ends first.

    Found by the fault matrix: a prewarm that hung kept the reserve, and so the whole job,
    from ever exiting after training finished. The end of the iteration (the job done, or a
    restart that may need this reserve) is delivered like a restart, by a daemon thread that
    waits on its own store client; a prewarm that raises makes this reserve unhealthy
    (retired at the next decision).
    """
    ended = threading.Event()

    def watch() -> None:
        try:
            iteration_end.wait_outcome(svc.new_client(), iteration, timeout=None, clock=svc.clock)
        except Exception as exc:
            log.debug("prewarm watcher: store unreachable: %r", exc)
            return
        if not ended.is_set():
            svc.interrupter.deliver()

    svc.interrupter.arm()
    threading.Thread(target=watch, name="inprocess-prewarm-watch", daemon=True).start()
    try:
        try:
            prewarm()
        except Exception as exc:
            log.exception("prewarm failed on reserve rank %d", svc.me)
            fault_records.report_fault(
                svc.store,
                iteration=iteration,
                initial_rank=svc.me,
                kind="unhealthy",
                detail=f"prewarm raised {exc!r}",
            )
        finally:
            ended.set()
            disarm(svc.interrupter)
    except RestartInterrupt:
        disarm(svc.interrupter)
        log.warning(
            "reserve rank %d: iteration %d ended during prewarm: prewarm abandoned",
            svc.me,
            iteration,
        )
