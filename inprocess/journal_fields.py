"""The JSON types of a journal record's fields, checked when a journal is read back.

A journal directory is input to the report: a line that another tool, a damaged disk or another
user wrote must end the report with one line naming the file and the field, not with a
``TypeError`` deep in the arithmetic. Each field the report reads has the type our writers give
it (``journal.record`` callers); a field not listed here is not read by the report and passes.
"""

from __future__ import annotations

import math
from typing import Any


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(v: Any) -> bool:
    return v is None or _int(v)


def _number(v: Any) -> bool:
    return (_int(v) or isinstance(v, float)) and math.isfinite(v)


def _opt_number(v: Any) -> bool:
    return v is None or _number(v)


def _opt_str(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(_int(x) for x in v)


def _list(v: Any) -> bool:
    return isinstance(v, list)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _opt_dict(v: Any) -> bool:
    return v is None or isinstance(v, dict)


_OPTIONAL_INTS = (
    "step",
    "training_rank",
    "round",
    "slot_rank",
    "proc_pid",
    "attempt",
    "status",
    "world_size",
    "node",
    "respawn_generation",
)
_RANK_LISTS = ("active_before", "active_after", "faulting_ranks", "reserve_after")
_NUMBERS = ("seconds", "decided", "write_s", "time")
_STRINGS = (
    "fault",
    "kind",
    "cause",
    "tier",
    "where",
    "reason",
    "exc_type",
    "detail",
    "verdict",
    "how",
    "outcome",
    "section",
)

# field -> (check, what our writers put there)
FIELDS: dict[str, tuple[Any, str]] = {
    "v": (_int, "an integer"),
    "t": (_number, "a finite number (seconds since the epoch)"),
    "event": (_str, "a string"),
    "host": (_str, "a string"),
    "launch": (_str, "a string"),
    "pid": (_int, "an integer"),
    "rank": (_int, "an integer"),  # the writer's own (open_journal)
    "iteration": (_int, "an integer"),  # Journal.set_position stamps an int, or nothing
    "fault_rank": (_int, "an integer"),  # a fault record's initial rank
    **dict.fromkeys(_OPTIONAL_INTS, (_opt_int, "an integer or null")),
    **dict.fromkeys(_RANK_LISTS, (_ints, "a list of integers")),
    **dict.fromkeys(_NUMBERS, (_opt_number, "a finite number")),
    **dict.fromkeys(_STRINGS, (_opt_str, "a string")),
    **dict.fromkeys(("in_collective", "active"), (_bool, "true or false")),
    "phases": (_opt_dict, "an object"),
    "suspect_hardware": (_list, "a list"),
    "stall_s": (_number, "a finite number"),  # absent: no stall (a save record of the user's)
}


# event -> fields it always carries (the report's progress, its restarts and fired faults)
_IT = ("iteration", _int, "an integer")
_EVENT_FIELDS: dict[str, tuple[tuple[str, Any, str], ...]] = {
    "step": (("step", _int, "an integer"),),
    "save": (("step", _int, "an integer"),),
    "iteration_start": (_IT,),
    "restart": (_IT,),
    "fault_fired": (("rank", _int, "an integer"),),
}


def problem(rec: dict[str, Any]) -> str | None:
    """What is wrong with ``rec``'s fields (``"field 't' is "x", not a finite number ..."``), or
    None when every field the report reads has its writers' type."""
    event = rec.get("event")
    for key, ok, what in _EVENT_FIELDS.get(event, ()) if isinstance(event, str) else ():
        if not ok(rec.get(key)):
            return f"field {key!r} of a {event!r} record is {rec.get(key)!r:.60}, not {what}"
    for key, (ok, what) in FIELDS.items():
        if key in rec and not ok(rec[key]):
            return f"field {key!r} is {rec[key]!r:.60}, not {what}"
    return None
