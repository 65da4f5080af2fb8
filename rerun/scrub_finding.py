"""What scrubbing found: the finding (which rank and host, which step, how it was settled, how
far the job rolls back), its log line and journal event, and the exception that hands it to the
restart."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

logger = logging.getLogger(__name__)
# The run journal's channel (see inprocess/journal.py; a name, so rerun need not import it).
_journal = logging.getLogger("restartable.journal")

Verdict = Literal["transient", "persistent", "nondeterministic"]


@dataclass(frozen=True)
class SdcFinding:
    """One mismatch of a checked step, settled.

    ``rank``: the training rank whose step was checked; ``step``: that step; ``verdict``:
    ``transient`` (the rank's own re-run gave the checker's result), ``persistent`` (it gave its
    first, wrong result again: its hardware is faulty) or ``nondeterministic`` (no two of the
    three agree); ``settled_by``: the computations compared; ``detected_at``: the step at which
    the job learned of it; ``rollback_to``: the step the job restarts from (the state before
    that step is trusted); ``steps_rolled_back``: ``detected_at - rollback_to``.
    """

    rank: int
    initial_rank: int
    host: str
    step: int
    verdict: Verdict
    settled_by: str
    detected_at: int
    rollback_to: int
    checker: str  # "in_place" or the reserve's "host:initial rank"
    digests: tuple[str, ...] = ()

    @property
    def steps_rolled_back(self) -> int:
        return self.detected_at - self.rollback_to

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "steps_rolled_back": self.steps_rolled_back}

    def line(self) -> str:
        what = {
            "transient": "a transient fault (the rank kept)",
            "persistent": "a persistent fault: the rank's hardware is retired",
            "nondeterministic": "no two computations agree: the step is not deterministic",
        }[self.verdict]
        return (
            f"silent data corruption on rank {self.rank} (initial {self.initial_rank}, host "
            f"{self.host}) at step {self.step}, found at step {self.detected_at}: {what}; "
            f"settled by {self.settled_by}; rolling back {self.steps_rolled_back} step(s) to "
            f"step {self.rollback_to}"
        )


def report_finding(finding: SdcFinding) -> None:
    """Log ``finding`` (WARNING) and journal it as an ``sdc_finding`` event when a journal is
    open in this process (the suspect rank calls it, once per finding)."""
    logger.warning("%s", finding.line())
    if _journal.handlers:
        fields = {k: v for k, v in finding.as_dict().items() if k != "digests"}
        fields["fault_rank"] = fields.pop("initial_rank")
        fields["training_rank"] = fields.pop("rank")
        _journal.debug("sdc_finding", extra={"journal": fields})


class Quarantines(Protocol):
    """What a finding tells the job's checkpoints: ``CheckpointManager`` is one."""

    def quarantine_after(self, step: int, *, finding: Mapping[str, Any] | None = None) -> None:
        """Never restore a checkpoint of a step after ``step`` (rank-local, never blocks)."""


def quarantine(checkpoints: Quarantines | None, finding: SdcFinding) -> None:
    """On every rank, when ``finding`` is settled and before the restart: every checkpoint of
    a step after the one the job rolls back to is distrusted (trained on the corrupt
    arithmetic, or not verified since), so no later restore may pick it: this run's after a
    later fault, a requeued job's, the user's own resume (``checkpoint.quarantine``)."""
    if checkpoints is None:
        return
    fields = {k: v for k, v in finding.as_dict().items() if k != "digests"}
    checkpoints.quarantine_after(finding.rollback_to, finding=fields)


class SilentDataCorruption(Exception):
    """Raised out of the step to restart the job from a verified step.

    ``restartable_rank_action``: ``"retire"`` on a rank found persistently faulty (the wrapper
    removes it, a warm reserve takes its place), else None (an ordinary restart).
    """

    def __init__(self, finding: SdcFinding, *, retire: bool) -> None:
        super().__init__(finding.line())
        self.finding = finding
        self.restartable_rank_action: Literal["retire"] | None = "retire" if retire else None
