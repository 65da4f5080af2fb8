"""The journal records of one launch, grouped as the downtime report reads them: by event, by
writing process, by in-job restart round. Pure; no I/O.
"""

from __future__ import annotations

from typing import Any


def by_event(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The records grouped by event name, each group in the records' order."""
    ev: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        ev.setdefault(str(r["event"]), []).append(r)
    return ev


def process_of(r: dict[str, Any]) -> tuple[Any, ...]:
    """The process that wrote ``r`` (a key to group by)."""
    # journal.read names each record's file (one per process); synthetic records may not.
    return (r["_file"],) if "_file" in r else (r.get("host"), r.get("pid"), r.get("rank"))


def round_starts(records: list[dict[str, Any]]) -> list[float]:
    """When each in-job restart round began (the first launcher to record it), in order."""
    first: dict[int, float] = {}
    for r in records:
        if r["event"] == "in_job_restart":
            k = int(r.get("round", len(first) + 1))
            first[k] = min(first.get(k, float(r["t"])), float(r["t"]))
    return [first[k] for k in sorted(first)]


def rounds(records: list[dict[str, Any]]) -> list[dict[str, list[dict[str, Any]]]]:
    """The ranks' records by event, one map per round (a process's round: the number of
    in-job restart rounds that began before its first record). Launcher records (rank < 0)
    are left out."""
    starts = round_starts(records)
    born: dict[tuple[Any, ...], float] = {}
    for r in records:
        born.setdefault(process_of(r), float(r["t"]))
    out: list[dict[str, list[dict[str, Any]]]] = [{} for _ in range(len(starts) + 1)]
    for r in records:
        if isinstance(r.get("rank"), int) and r["rank"] < 0:
            continue
        k = sum(t <= born[process_of(r)] for t in starts)
        out[k].setdefault(str(r["event"]), []).append(r)
    return out
