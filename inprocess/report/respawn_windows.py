"""The respawn windows of one launch's downtime report: each process the launcher replaced, from
its death's first sign until its replacement is a ready reserve (the terms are defined in
``inprocess.report.downtime``'s docstring). Outside the downtime sum: the ranks that train go on
meanwhile. Pure; no I/O.
"""

from __future__ import annotations

from typing import Any

from restartable.inprocess.report.records import round_starts
from restartable.inprocess.report.terms import RespawnWindow

# Injected faults (inprocess.faults, inprocess.faults.drill) after which the process is gone: the
# first sign of a respawn's death. A process may die between its own record and the signal,
# but never write another record after it, so its last one of these is the one.
_PROCESS_ENDING = frozenset({"kill", "hang_gil", "rank_killed", "rank_hung"})


def respawn_windows(
    records: list[dict[str, Any]],
    ev: dict[str, list[dict[str, Any]]],
    rounds: list[dict[str, list[dict[str, Any]]]],
) -> list[RespawnWindow]:
    """One window per "respawn" record of the launcher, in its order. ``ev``: every record by
    event (``records.by_event``); ``rounds``: the ranks' records by event, per round."""
    starts = round_starts(records)
    last_of, killed_by = _last_records(records)
    out = []
    for rec in ev.get("respawn", []):
        detected, identity = float(rec["t"]), int(rec["identity"])
        k = sum(t <= detected for t in starts)
        proc = (rec.get("host"), rec.get("proc_pid"))
        fired = killed_by.get(proc)
        if fired is not None and float(fired["t"]) <= detected:
            sign, fault = float(fired["t"]), fired.get("fault")
        else:  # a fault record that blames it, written after its own last record
            after = last_of.get(proc, float("-inf"))
            blamed = [
                float(r["t"])
                for r in rounds[k].get("fault", [])
                if r.get("fault_rank") == identity and after <= float(r["t"]) <= detected
            ]
            sign, fault = min(blamed, default=detected), None
        spawned, new, ready = _replacement(ev, identity, detected)
        out.append(
            RespawnWindow(
                slot_rank=int(rec.get("slot_rank", identity)),
                identity=identity,
                how=str(rec.get("how", "")),
                sign=sign,
                detected=detected,
                spawned=spawned,
                ready=ready,
                new_identity=new,
                fault=fault,
            )
        )
    return out


def _last_records(
    records: list[dict[str, Any]],
) -> tuple[dict[Any, float], dict[Any, dict[str, Any]]]:
    """Per rank process ``(host, pid)``: the time of its last record, and its last injected
    fault that ends a process (launcher records, rank < 0, left out)."""
    last_of: dict[Any, float] = {}
    killed_by: dict[Any, dict[str, Any]] = {}
    for r in records:
        if r.get("pid") is None or (isinstance(r.get("rank"), int) and r["rank"] < 0):
            continue
        last_of[(r.get("host"), r["pid"])] = float(r["t"])
        if r["event"] == "fault_fired" and r.get("kind") in _PROCESS_ENDING:
            killed_by[(r.get("host"), r["pid"])] = r
    return last_of, killed_by


def _replacement(
    ev: dict[str, list[dict[str, Any]]], identity: int, detected: float
) -> tuple[float | None, int | None, float | None]:
    """The process started in place of ``identity`` after ``detected``: when it was spawned,
    its identity, when it registered as a reserve (None for what did not happen)."""
    started = [
        r
        for r in ev.get("respawn_started", [])
        if r.get("replaces") == identity and float(r["t"]) >= detected
    ]
    spawned = float(started[0]["t"]) if started else None
    new = int(started[0]["identity"]) if started else None
    ready = next(
        (
            float(r["t"])
            for r in ev.get("reserve_ready", [])
            if new is not None and int(r["identity"]) == new
        ),
        None,
    )
    return spawned, new, ready
