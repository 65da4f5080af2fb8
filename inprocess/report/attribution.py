"""Fault attribution: what kind of fault, and where it most likely came from (pure rules).

Input: the journal records of one or several launches or jobs (``journal.read`` of each run
directory). Every fault becomes one ``Finding``: its class (crash, hang, numerical, slowdown),
a suspected origin (hardware, application, infrastructure, unknown) and the evidence, i.e.
the rule that fired and the hosts, steps and launches involved. The rules, first match wins:

1. infrastructure: a storage error (the error text names ENOSPC, EIO, a read-only or full
   file system, or a checkpoint storage error), a lost coordination store, or at least half of
   a launch's ranks failing in collectives within ``BURST_S`` with no fault of their own.
2. application: the same error (exception type, place, step) on two or more hosts: code or
   data, not a machine.
3. hardware: two or more faults on one host at different steps or in different launches; a
   failed health check; a re-run verdict that the fault persists on that hardware. The host
   is named with a Slurm ``--exclude`` line.
4. unknown: none of the above (one fault, once).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

CRASH_KINDS = frozenset({"exception", "dead", "unhealthy", "completion_timeout"})
HANG_KINDS = frozenset({"soft_timeout", "hard_timeout", "section_timeout"})
BURST_S = 2.0
_STORAGE = re.compile(
    r"ENOSPC|No space left|EIO|Input/output error|Read-only file system|Disk quota|"
    r"CheckpointStorageError|Stale file handle",
    re.IGNORECASE,
)
_STORE = re.compile(r"store unreachable|DistStoreError|StoreTimeoutError|TCPStore", re.IGNORECASE)


@dataclass(frozen=True)
class Fault:
    """One fault as the journal saw it (from a "fault" or "rerun_verdict" record)."""

    launch: str
    iteration: int
    rank: int
    host: str
    kind: str
    exc_type: str
    where: str
    step: int | None
    detail: str
    in_collective: bool
    t: float

    @property
    def signature(self) -> tuple[str, str, int | None]:
        return (self.exc_type or self.kind, self.where, self.step)


@dataclass
class Finding:
    """The classification of one fault, with the evidence for it."""

    fault: Fault
    fault_class: str  # crash | hang | numerical | slowdown
    origin: str  # hardware | application | infrastructure | unknown
    rule: str
    hosts: list[str] = field(default_factory=list)
    steps: list[int | None] = field(default_factory=list)
    launches: list[str] = field(default_factory=list)
    exclude: str = ""  # e.g. "--exclude=node7" for a hardware origin

    def as_dict(self) -> dict[str, Any]:
        f = self.fault
        return {
            "launch": f.launch,
            "iteration": f.iteration,
            "rank": f.rank,
            "host": f.host,
            "kind": f.kind,
            "error": f.exc_type,
            "where": f.where,
            "step": f.step,
            "class": self.fault_class,
            "origin": self.origin,
            "rule": self.rule,
            "hosts": self.hosts,
            "steps": self.steps,
            "launches": self.launches,
            "exclude": self.exclude,
        }


def faults_of(records: list[dict[str, Any]]) -> list[Fault]:
    """The faults in journal records: "fault" records and re-run verdicts that name a fault."""
    host_of = {
        (str(r.get("launch", "")), int(r["rank"])): str(r.get("host", ""))
        for r in records
        if "rank" in r and r.get("host")
    }
    out = []
    for r in records:
        event = r.get("event")
        launch = str(r.get("launch", ""))
        if event == "fault":
            rank = int(r.get("fault_rank", r.get("rank", -1)))
            out.append(
                Fault(
                    launch=launch,
                    iteration=int(r.get("iteration", 0)),
                    rank=rank,
                    host=host_of.get((launch, rank), str(r.get("host", ""))),
                    kind=str(r.get("kind", "")),
                    exc_type=str(r.get("exc_type", "")),
                    where=str(r.get("where", "")),
                    step=r.get("step"),
                    detail=str(r.get("detail", "")),
                    in_collective=bool(r.get("in_collective", False)),
                    t=float(r["t"]),
                )
            )
        elif event == "rerun_verdict" and r.get("verdict") not in (None, "correct_result"):
            out.append(
                Fault(
                    launch=launch,
                    iteration=int(r.get("iteration", 0)),
                    rank=int(r.get("rank", -1)),
                    host=str(r.get("host", "")),
                    kind="rerun:" + str(r["verdict"]),
                    exc_type="",
                    where="",
                    step=r.get("step"),
                    detail=", ".join(map(str, r.get("suspect_hardware", []))),
                    in_collective=False,
                    t=float(r["t"]),
                )
            )
    return out


def classify(f: Fault) -> str:
    """crash | hang | numerical | slowdown."""
    if f.kind.startswith("rerun:") or f.exc_type == "FloatingPointError":
        return "numerical"
    if f.kind in HANG_KINDS:
        return "hang"
    if f.kind == "straggler":
        return "slowdown"
    return "crash"


def attribute(faults: list[Fault]) -> list[Finding]:
    """One ``Finding`` per fault that is not a consequence of another (collective failures that
    are not part of a burst are left out: the fault of their peer is the one to explain)."""
    by_sig: dict[tuple[str, str, int | None], list[Fault]] = defaultdict(list)
    by_host: dict[str, list[Fault]] = defaultdict(list)
    for f in faults:
        if not f.in_collective:
            by_sig[f.signature].append(f)
            if f.host:
                by_host[f.host].append(f)
    out = []
    for f in faults:
        burst = _burst(f, faults)
        if f.in_collective and not burst:
            continue
        out.append(_finding(f, burst, by_sig, by_host))
    return out


def _finding(
    f: Fault,
    burst: list[Fault],
    by_sig: dict[tuple[str, str, int | None], list[Fault]],
    by_host: dict[str, list[Fault]],
) -> Finding:
    cls = classify(f)
    text = f"{f.exc_type} {f.detail}"
    if _STORAGE.search(text):
        return Finding(f, cls, "infrastructure", "storage error", [f.host], [f.step], [f.launch])
    if _STORE.search(text):
        return Finding(f, cls, "infrastructure", "coordination store lost", [f.host])
    if burst:
        hosts = sorted({b.host for b in burst})
        return Finding(
            f, cls, "infrastructure", f"{len(burst)} ranks failed in collectives at once", hosts
        )
    same = by_sig.get(f.signature, [])
    hosts = sorted({s.host for s in same if s.host})
    if len(hosts) >= 2 and f.exc_type:
        return Finding(
            f, cls, "application", "the same error at the same step on different hosts",
            hosts, sorted({s.step for s in same}, key=_step_key), sorted({s.launch for s in same}),
        )  # fmt: skip
    if f.kind == "unhealthy" or "persistent" in f.kind:
        return _hardware(f, cls, "a failed health check or a persistent re-run verdict", [f])
    mine = by_host.get(f.host, []) if f.host else []
    steps = {m.step for m in mine}
    launches = {m.launch for m in mine}
    if len(mine) >= 2 and (len(steps) >= 2 or len(launches) >= 2):
        return _hardware(f, cls, "recurs on one host at different steps or launches", mine)
    return Finding(f, cls, "unknown", "seen once", [f.host], [f.step], [f.launch])


def _hardware(f: Fault, cls: str, rule: str, evidence: list[Fault]) -> Finding:
    return Finding(
        f, cls, "hardware", rule, [f.host],
        sorted({e.step for e in evidence}, key=_step_key), sorted({e.launch for e in evidence}),
        exclude=f"--exclude={f.host}" if f.host else "",
    )  # fmt: skip


def _burst(f: Fault, faults: list[Fault]) -> list[Fault]:
    """Collective failures of many ranks at once in f's launch and iteration, with no rank's
    own fault among them: a network problem rather than any one rank's."""
    same = [g for g in faults if g.launch == f.launch and g.iteration == f.iteration]
    if any(not g.in_collective for g in same):
        return []
    close = [g for g in same if abs(g.t - f.t) <= BURST_S]
    ranks = {g.rank for g in close}
    return close if len(ranks) >= 2 else []


def _step_key(step: int | None) -> int:
    return -1 if step is None else step
