"""The types of a checkpointed machine state's fields, checked before ``persist.decode`` uses them.

A checkpoint is input: a state dict that a damaged file or another user wrote must fail with a
``RerunConfigError`` naming the field and the rule, not with a ``ValueError`` from ``int()`` or
an ``AttributeError`` in a later step. Each field must hold what ``persist.encode`` writes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from restartable.rerun.errors import RerunConfigError
from restartable.rerun.state_machine import RerunMode, State


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return _int(v) or isinstance(v, float)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _bytes(v: Any) -> bool:
    return isinstance(v, (bytes, bytearray))


_TYPES: dict[str, tuple[Any, str]] = {
    "version": (_int, "an int"),
    "mode": (lambda v: _str(v) and v in {m.value for m in RerunMode}, "a RerunMode value"),
    "state": (lambda v: _str(v) and v in {s.value for s in State}, "a State value"),
    "iteration": (lambda v: _int(v) and v >= 0, "an int >= 0"),
    "rank": (lambda v: _int(v) and v >= 0, "an int >= 0"),
    "world_size": (lambda v: _int(v) and v > 0, "an int > 0"),
    "hardware_id": (_str, "a str"),
    "failed_message": (_str, "a str"),
    "failed_seq": (_int, "an int"),
    "failed_fatal": (lambda v: isinstance(v, bool), "a bool"),
    "failed_tolerance": (lambda v: _number(v) and math.isfinite(v) and v >= 0, "a float >= 0"),
    "initial_result": (_number, "a float"),
    "suspect_hardware": (_str, "a str"),
    "faulty_hardware": (_str, "a JSON list of str"),
    "large_values": (_str, "a JSON object of [count, mean] pairs"),
    "injector": (_str, "a JSON object"),
    "rng": (_bytes, "bytes"),
    "data": (_bytes, "bytes"),
}


def _json_ok(field: str, value: Any) -> bool:
    if field == "faulty_hardware":
        return isinstance(value, list) and all(_str(x) for x in value)
    if field == "large_values":
        return isinstance(value, dict) and all(
            isinstance(p, list) and len(p) == 2 and _number(p[0]) and _number(p[1])
            for p in value.values()
        )
    injected = value.get("injected") if isinstance(value, dict) else "not a dict"
    return injected is None or (
        isinstance(injected, list)
        and len(injected) == 4
        and _int(injected[0])
        and _int(injected[2])
        and all(_str(injected[i]) for i in (1, 3))
    )


def check(sd: Mapping[str, Any]) -> None:
    """Raise ``RerunConfigError`` naming the first field of ``sd`` that does not hold what
    ``persist.encode`` writes (the JSON fields parsed and their shape checked too)."""
    for field, (ok, what) in _TYPES.items():
        value = sd[field]
        good = ok(value)
        if good and field in ("faulty_hardware", "large_values", "injector"):
            try:
                good = _json_ok(field, json.loads(value))
            except ValueError:
                good = False
        if not good:
            raise RerunConfigError(
                f"state_dict[{field!r}] is {value!r:.60}, not {what}: it was not written by "
                "RerunStateMachine.state_dict(); load a checkpoint this job wrote"
            )


def check_data(data: Any) -> Any:
    """``data`` when it has the shape of a pending re-run's microbatches (one list per data
    iterator); otherwise ``RerunConfigError`` naming the field."""
    if not (isinstance(data, list) and all(isinstance(d, list) for d in data)):
        raise RerunConfigError(
            f"state_dict['data'] holds a {type(data).__name__}, not a list of microbatch lists:"
            " it was not written by RerunStateMachine.state_dict()"
        )
    return data
