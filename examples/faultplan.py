"""Parse the example's ``--faults`` plan and fire each planned fault exactly once.

Plan syntax: comma-separated ``KIND@rankR:stepS``, e.g.
``exception@rank1:step30,kill@rank2:step60,hang@rank0:step90,nan@rank1:step120``; ``demo`` is a
preset that shows each kind once, ``none`` (or empty) plans nothing. ``rankR`` is the training
rank (``ctx.rank``) at the time the step runs.

A fault fires once per run even though the step replays after the restart: the firing rank
first creates a marker file with O_EXCL in the run directory, so a replay (or a reserve that took
the faulty rank's place) sees the marker and carries on.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = {
    "exception": "a Python exception in train() (restart in place)",
    "kill": "SIGKILL of the rank's process (a warm reserve takes its place)",
    "hang": "a hang with the GIL released (detected by the soft timeout)",
    "hang_gil": "a hang with the GIL held (killed at the hard timeout; a reserve takes over)",
    "nan": "a NaN loss on one rank (re-run in place by the re-run state machine)",
}

# Faults after which a warm reserve must take the rank's place (the rank is gone).
LOSES_RANK = ("kill", "hang_gil")

_ITEM = re.compile(r"^(?P<kind>[a-z_]+)@rank(?P<rank>\d+):step(?P<step>\d+)$")


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    rank: int
    step: int

    @property
    def name(self) -> str:
        return f"{self.kind}@rank{self.rank}:step{self.step}"


def demo_plan(steps: int) -> str:
    """Each kind once, spread over the run (needs at least 2 active ranks and one reserve)."""
    at = [max(1, steps * k // 6) for k in range(1, 6)]
    return (
        f"exception@rank1:step{at[0]},kill@rank1:step{at[1]},hang@rank0:step{at[2]},"
        f"nan@rank1:step{at[3]},exception@rank0:step{at[4]}"
    )


def parse_plan(text: str, *, steps: int) -> list[PlannedFault]:
    """Parse a plan; raises ValueError naming the bad item and the accepted syntax."""
    if text in ("", "none"):
        return []
    if text == "demo":
        text = demo_plan(steps)
    plan = []
    for item in text.split(","):
        m = _ITEM.match(item.strip())
        if m is None or m["kind"] not in KINDS:
            raise ValueError(
                f"--faults item {item!r} is not KIND@rankR:stepS with KIND one of "
                f"{sorted(KINDS)}: write e.g. exception@rank1:step30"
            )
        fault = PlannedFault(m["kind"], int(m["rank"]), int(m["step"]))
        if fault.step >= steps:
            raise ValueError(
                f"--faults item {item!r} is at step {fault.step}, but the run has only "
                f"{steps} steps (0..{steps - 1}): choose an earlier step or raise --steps"
            )
        plan.append(fault)
    return plan


def claim(run_dir: Path, fault: PlannedFault) -> bool:
    """True exactly once per run for a fault: the caller must fire it right away.

    The marker records the wall-clock instant of the fault, which the downtime report uses as
    the start of detection.
    """
    fired = run_dir / "fired"
    fired.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(fired / f"{fault.name}.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"fault": fault.name, "kind": fault.kind, "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def fired_faults(run_dir: Path) -> list[dict[str, object]]:
    """Every fault that fired in this run, oldest first."""
    records = [json.loads(p.read_text()) for p in (run_dir / "fired").glob("*.json")]
    return sorted(records, key=lambda r: float(r["time"]))  # type: ignore[arg-type]
