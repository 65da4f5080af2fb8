"""Acting on an exit decision: the ``RerunExit`` to raise, or the process exit itself.

Called by ``RerunStateMachine.exit_or_raise`` / ``exit_exception`` on the training loop's thread
(every rank), after ``should_checkpoint_and_exit`` said exit. ``leave`` never returns: it exits
the process or raises; it may block on the closes (bounded) and on the peer's teardown.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Iterable
from typing import Any, NoReturn

from restartable.rerun import agree, verdicts
from restartable.rerun.errors import InvalidTransition, RankAction, RerunExit
from restartable.rerun.state_machine import Diagnostic, State, exit_decision

logger = logging.getLogger(__name__)


def exit_exception(
    code: int,
    verdict: Diagnostic | None,
    action: RankAction | None,
    what: str,
    *,
    suspects: verdicts.Suspects,
    iteration: int,
) -> RerunExit:
    """The ``RerunExit`` for ``code`` at ``iteration`` (not raised)."""
    return RerunExit(
        code,
        verdict=verdict.value if verdict else None,
        suspect_ranks=suspects.ranks,
        suspect_hardware=suspects.hardware,
        restartable_rank_action=action,
        message=f"iteration {iteration}: {what}",
    )


def retired(hardware_id: str, suspects: verdicts.Suspects, *, iteration: int) -> RerunExit:
    """The ``RerunExit(retire)`` of an ``in_job`` rank that starts a step on hardware known to
    have had a persistent fault."""
    return exit_exception(
        17,
        Diagnostic.PERSISTENT_ERROR,
        "retire",
        f"hardware {hardware_id} had a persistent fault: retire this rank",
        suspects=suspects,
        iteration=iteration,
    )


def decided(
    state: State,
    verdict: Diagnostic | None,
    *,
    rank: int,
    hardware_id: str,
    suspects: verdicts.Suspects,
    iteration: int,
) -> RerunExit:
    """The ``RerunExit`` of the exit decision in ``state`` (``RerunStateMachine.exit_exception``).
    Raises ``InvalidTransition`` when ``state`` asks for no exit."""
    _ckpt, do_exit, code = exit_decision(state)
    if not do_exit:
        raise InvalidTransition(
            f"exit_or_raise() called in state {state.value}, where no verdict asks to "
            "exit: call it only when should_checkpoint_and_exit() returns exit=True"
        )
    action = verdicts.rank_action(
        code, rank=rank, hardware_id=hardware_id, verdict=verdict, suspects=suspects
    )
    what = verdicts.exit_message(state, verdict)
    return exit_exception(code, verdict, action, what, suspects=suspects, iteration=iteration)


def leave(
    exc: RerunExit,
    *,
    standalone: bool,
    suspect: bool,
    close: Iterable[Any],
    close_timeout: float,
) -> NoReturn:
    """``standalone``: close ``close`` (each bounded), destroy the groups and exit with the
    code. Otherwise raise ``exc`` for ``@restartable``; a rank with no action that is not
    ``suspect`` first waits for the suspect's restart to tear the default group down."""
    if standalone:
        close_bounded(close, close_timeout)
        distributed = agree.is_distributed()
        agree.destroy_before_exit()
        if distributed:
            agree.exit_now(exc.exit_code)
        sys.exit(exc.exit_code)
    if exc.restartable_rank_action is None and not suspect:
        agree.wait_for_teardown()
    raise exc


def close_bounded(owners: Iterable[Any], timeout: float) -> None:
    """``owner.close()`` for each of ``owners``, each in a helper thread bounded by ``timeout``
    seconds (a hung storage must not keep the process from leaving with its verdict); a failure
    or an overrun is logged at ERROR, and the exit goes on."""
    if not 0 < timeout < math.inf:
        raise ValueError(f"close_timeout ({timeout}) must be > 0 seconds and finite")
    for owner in owners:
        errors: list[BaseException] = []

        def run(owner: Any = owner, errors: list[BaseException] = errors) -> None:
            try:
                owner.close()
            except BaseException as exc:  # reported below, on the exiting thread
                errors.append(exc)

        t = threading.Thread(target=run, name="rerun-close-before-exit", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            logger.error("%r did not close within %.0f s; exiting anyway", owner, timeout)
        elif errors:
            logger.error("closing %r before the exit failed: %r", owner, errors[0])
