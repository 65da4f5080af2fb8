"""A verdict's traces: one INFO line, and the run journal's ``rerun_verdict`` event.

Called by ``RerunStateMachine`` on the training loop's thread when a transition gives a verdict
(every rank, once per verdict); never blocks.
"""

from __future__ import annotations

import logging

from restartable.rerun.state_machine import Diagnostic
from restartable.rerun.verdicts import Suspects

logger = logging.getLogger(__name__)
# The run journal's channel (see inprocess/journal.py; a name, so rerun need not import it).
_journal = logging.getLogger("restartable.journal")


def report_verdict(iteration: int, verdict: Diagnostic, suspects: Suspects) -> None:
    """Log ``verdict`` at ``iteration`` (rerun's iteration is the training step) and journal it
    when a journal is open in this process."""
    logger.info(
        "iteration %d verdict: %s (suspect ranks %s, hardware %s)",
        iteration,
        verdict.value,
        list(suspects.ranks),
        list(suspects.hardware),
    )
    if not _journal.handlers:
        return
    _journal.debug(
        "rerun_verdict",
        extra={
            "journal": {
                "step": iteration,  # rerun's iteration is the training step
                "verdict": verdict.value,
                "suspect_ranks": list(suspects.ranks),
                "suspect_hardware": list(suspects.hardware),
            }
        },
    )
