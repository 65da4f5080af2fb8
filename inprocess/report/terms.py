"""The downtime report's terms: one launch's report (``LaunchReport``), its fault windows
(``Window``) and respawn windows (``RespawnWindow``). Built by ``inprocess.report.downtime.build``;
the definitions of every term are in that module's docstring. Pure data; no I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

IN_PROCESS = "in-process"
IN_JOB = "in-job"


@dataclass
class Window:
    """One fault's downtime window and its terms (seconds)."""

    iteration: int  # the iteration that faulted (of its round)
    cause: str
    faulting_ranks: list[int]
    kind: str
    last: float
    sign: float
    detected: float
    reentered: float
    restored: float
    back: float
    tier: str | None
    restored_step: int | None
    reached_step: int
    fault: str | None = None  # the injected fault whose "fault_fired" record is ``sign``
    level: str = IN_PROCESS  # or IN_JOB: inprocess.launch restarted every rank
    round: int = 0  # the in-job restart round the fault happened in
    resumed: float | None = None  # rank 0's first step after ``reentered``
    # The blamed ranks' training ranks in the faulted iteration (what a fault plan and
    # ``ctx.rank`` call them), in the order of ``faulting_ranks``; None where unknown.
    training_ranks: list[int | None] = field(default_factory=list)
    # The tier each active rank restored from, e.g. "memory on 1 rank, node-local on 1 rank (the
    # reserve)" (``inprocess.restart.restored.phrase``); None without the ranks' restores.
    tiers: str | None = None

    @property
    def terms(self) -> dict[str, float]:
        return {
            "lost_before": self.sign - self.last,
            "detection": self.detected - self.sign,
            "restart": self.reentered - self.detected,
            "reload": self.restored - self.reentered,
            "redo": self.back - self.restored,
            "downtime": self.back - self.last,
        }

    @property
    def recovery(self) -> float | None:
        """Detection to rank 0's first step after it (None without a step)."""
        return None if self.resumed is None else self.resumed - self.detected


@dataclass
class RespawnWindow:
    """A process the launcher replaced: from its death until the new one is a ready reserve."""

    slot_rank: int  # the slot's RANK
    identity: int  # the dead process's identity (``inprocess.protocol.ranks.respawn_identity``)
    how: str  # e.g. "was killed by SIGKILL"
    sign: float
    detected: float
    spawned: float | None  # None: not started (the job ended first)
    ready: float | None  # None: it never registered (died at start-up, or the job ended)
    new_identity: int | None = None
    fault: str | None = None  # the injected fault that killed it

    @property
    def terms(self) -> dict[str, float | None]:
        spawned, ready = self.spawned, self.ready
        return {
            "detection": self.detected - self.sign,
            "start": None if spawned is None else spawned - self.detected,
            "join": None if spawned is None or ready is None else ready - spawned,
            "recovery": None if ready is None else ready - self.detected,
        }


@dataclass
class LaunchReport:
    """The terms of one launch; ``wall == startup + productive + downtime`` by construction."""

    launch: str
    start: float
    end: float
    startup: float
    checkpoint: float
    windows: list[Window] = field(default_factory=list)
    restarts: int = 0
    steps: int | None = 0  # the highest step rank 0 reached (None: no step known, see below)
    respawns: int = 0  # processes the launcher started again (its journal, when it keeps one)
    in_job_restarts: int = 0
    respawn_windows: list[RespawnWindow] = field(default_factory=list)
    progress_source: str = "ping"  # "ping" | "saves" | "probe" (see the module docstring)
    progress: list[tuple[float, int]] = field(default_factory=list, repr=False)

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def downtime(self) -> float:
        return self.checkpoint + sum(w.terms["downtime"] for w in self.windows)

    @property
    def productive(self) -> float:
        return self.wall - self.startup - self.downtime

    @property
    def goodput(self) -> float:
        return self.productive / self.wall if self.wall > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "launch": self.launch,
            "wall_s": self.wall,
            "startup_s": self.startup,
            "productive_s": self.productive,
            "downtime_s": self.downtime,
            "checkpoint_s": self.checkpoint,
            "goodput": self.goodput,
            "restarts": self.restarts,
            "respawns": self.respawns,
            "in_job_restarts": self.in_job_restarts,
            "steps": self.steps,
            "progress_source": self.progress_source,
            "faults": [
                {
                    **asdict(w),
                    **{f"{k}_s": v for k, v in w.terms.items()},
                    "recovery_s": w.recovery,
                }
                for w in self.windows
            ],
            "respawn_windows": [
                {**asdict(w), **{f"{k}_s": v for k, v in w.terms.items()}}
                for w in self.respawn_windows
            ],
        }
