"""Kept only for ``benchmarks/goodput.py`` and ``benchmarks/goodput_baseline.py``, which import
it: the fault plan, the fire-once claim and the record now live in ``inprocess.faults``. Remove
this file once those two import ``inprocess.faults`` directly."""

from __future__ import annotations

import os
import time
from pathlib import Path

from inprocess.faults import KINDS, FiredFault, PlannedFault, fired, parse_plan
from inprocess.faults.record import record_once

__all__ = ["LOSES_RANK", "PlannedFault", "claim", "fired_faults", "parse_plan"]

LOSES_RANK = tuple(name for name, kind in KINDS.items() if kind.loses_rank)


def claim(run_dir: Path, fault: PlannedFault) -> bool:
    """Claim and record ``fault`` (True once per run dir); the caller then fires it itself."""
    record = FiredFault(
        fault=fault.name,
        kind=fault.kind,
        rank=fault.rank,
        initial_rank=int(os.environ.get("RANK", fault.rank)),
        iteration=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        step=fault.step,
        time=time.time(),
        pid=os.getpid(),
    )
    return record_once(run_dir, record)


def fired_faults(run_dir: Path) -> list[dict[str, object]]:
    """Every fault recorded in ``run_dir``, oldest first, as the report reads them."""
    return [f.as_dict() for f in fired(run_dir)]
