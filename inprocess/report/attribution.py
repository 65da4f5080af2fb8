"""Fault attribution: one finding per fault window, its class and its likely origin (pure rules).

Input: the journal records of one or several launches or jobs (``journal.read`` of each run
directory), turned into evidence by ``inprocess.report.evidence``. A fault window is one restart
iteration that faulted, ``(launch, round, iteration)``; every window gets exactly one
``Finding``, however many ranks wrote about it (the NaN's re-run verdict is written by every
rank; a killed rank's peers record broken collectives; the killed rank writes nothing). The
finding names the fault's class and a suspected origin with the rule that fired and its
evidence. Classes: ``kill`` (the process died), ``hang`` (soft, section, atomic or hard
timeout), ``exception``, ``numerical`` (a re-run verdict, a ``FloatingPointError``),
``sdc`` (silent data corruption found by scrubbing: rank, host, step, how it was settled, the
steps rolled back), ``straggler``, ``unhealthy`` (a failed health check). Origins, first match wins:

0. injected: the fault plan or a drill fired it (a ``fault_fired`` record of the blamed process
   in the window): what the plan says, nothing to attribute.
1. infrastructure: a storage error (ENOSPC, EIO, a read-only or full file system, a checkpoint
   storage error), a lost coordination store or network error, or two or more ranks failing in
   collectives at once with no fault of their own.
2. hardware, direct evidence: a failed health check, an NVML/CUDA/Xid/ECC error, a re-run
   verdict that the fault persists on that hardware.
3. application: every rank that faulted in the window (two or more) hit the same exception at
   the same code location; or the same error (type, place, step) on two or more hosts; or the
   same exception at the same place and step in two or more windows (a deterministic repeat,
   which is also what stops the restarts with ``max_same_fault``).
4. hardware, by recurrence: the host faulted in two or more launches while the set holds
   several hosts (on a single host every fault recurs there: no evidence).
5. unknown: none of the above.

A Slurm ``--exclude`` line is suggested only for a hardware origin in a set with several hosts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from restartable.inprocess.errors import is_numerical
from restartable.inprocess.protocol.fault_evidence import HARDWARE, STORAGE, STORE
from restartable.inprocess.report.evidence import Fault, Window, faults_of

__all__ = ["Fault", "Finding", "analyse", "attribute", "classify", "faults_of"]

HANG_KINDS = frozenset({"soft_timeout", "hard_timeout", "section_timeout", "atomic_timeout"})
GONE_KINDS = frozenset({"dead"})
BURST_S = 2.0


@dataclass
class Finding:
    """The classification of one fault window, with the evidence for it."""

    fault: Fault
    fault_class: str  # kill | hang | exception | numerical | sdc | straggler | unhealthy
    origin: str  # injected | hardware | application | infrastructure | unknown
    rule: str
    hosts: list[str] = field(default_factory=list)
    steps: list[int | None] = field(default_factory=list)
    launches: list[str] = field(default_factory=list)
    exclude: str = ""  # e.g. "--exclude=node7": a hardware origin among several hosts
    ranks: list[int] = field(default_factory=list)  # initial ranks with a fault of their own

    def as_dict(self) -> dict[str, Any]:
        f = self.fault
        return {
            "launch": f.launch,
            "round": f.round,
            "iteration": f.iteration,
            "rank": f.rank,
            "training_rank": f.training_rank,
            "host": f.host,
            "kind": f.kind,
            "error": f.exc_type,
            "where": f.where,
            "step": f.step,
            "injected": f.injected,
            "class": self.fault_class,
            "origin": self.origin,
            "rule": self.rule,
            "hosts": self.hosts,
            "steps": self.steps,
            "launches": self.launches,
            "ranks": self.ranks,
            "exclude": self.exclude,
            **({"sdc": f.detail} if self.fault_class == "sdc" else {}),
        }

    def line(self) -> str:
        """One line for the report: where, what, why, and the advice if any."""
        f = self.fault
        if f.training_rank is not None:
            who = f"rank {f.training_rank} (initial {f.rank})"
        else:
            who = f"initial rank {f.rank}"
        step = "-" if f.step is None else str(f.step)
        return (
            f"{f.launch or '-'} it {f.iteration} step {step} {who} on {f.host or '?'}: "
            f"{self.fault_class}, origin {self.origin}: {self.rule}"
            + (f"; hosts {', '.join(self.hosts)}" if self.origin == "hardware" else "")
            + (f"; {self.exclude}" if self.exclude else "")
            + (f"; sdc: {f.detail}" if self.fault_class == "sdc" else "")
        )


def analyse(records: list[dict[str, Any]]) -> list[Finding]:
    """The findings of a set of journal records (one or several directories), by time."""
    hosts = {str(r["host"]) for r in records if r.get("host")}
    return attribute(faults_of(records), hosts=hosts)


def classify(f: Fault) -> str:
    """kill | hang | exception | numerical | sdc | straggler | unhealthy."""
    if f.kind.startswith("sdc:"):
        return "sdc"
    if f.kind.startswith("rerun:") or is_numerical(f.exc_type):
        return "numerical"
    if f.kind in HANG_KINDS:
        return "hang"
    if f.kind in GONE_KINDS:
        return "kill"
    if f.kind in ("straggler", "unhealthy"):
        return f.kind
    return "exception"


def attribute(faults: list[Fault], *, hosts: Iterable[str] | None = None) -> list[Finding]:
    """Exactly one ``Finding`` per fault window, oldest first.

    ``hosts``: every host of the records (default: the hosts of ``faults``); an ``--exclude``
    line is given only when there are several.
    """
    known = {h for h in (hosts if hosts is not None else (f.host for f in faults)) if h}
    windows: dict[Window, list[Fault]] = defaultdict(list)
    for f in faults:
        windows[f.window].append(f)
    primaries = {w: _primary(fs) for w, fs in windows.items()}
    by_sig: dict[tuple[str, str, int | None], list[Fault]] = defaultdict(list)
    for p in primaries.values():
        if not p.in_collective and not p.injected:
            by_sig[p.signature].append(p)
    several = len(known) >= 2
    out = [_finding(primaries[w], windows[w], by_sig, several_hosts=several) for w in windows]
    # Recurrence, last: only the faults no other rule explained count against their host.
    by_host: dict[str, list[Fault]] = defaultdict(list)
    for x in out:
        if x.origin in ("unknown", "hardware") and x.fault.host:
            by_host[x.fault.host].append(x.fault)
    for i, x in enumerate(out):
        mine = by_host.get(x.fault.host, [])
        if x.origin == "unknown" and several and len({m.launch for m in mine}) >= 2:
            rule = "the host faulted again in another launch"
            out[i] = _evidence(
                x.fault, x.fault_class, "hardware", rule, mine, x.ranks, several_hosts=several
            )
    return sorted(out, key=lambda x: x.fault.t)


def _primary(window: list[Fault]) -> Fault:
    """The fault that explains the window: a re-run verdict (the numerical fault, not the
    exception that carries it out of ``train()``), else a rank's own fault (the injected one
    first, then the earliest), else the earliest collective failure."""
    verdicts = [f for f in window if f.kind.startswith(("rerun:", "sdc:"))]
    if verdicts:
        # Every rank writes the verdict: the one of the rank whose exception carried it out.
        raisers = {f.rank for f in window if f.exc_type}
        v = min(verdicts, key=lambda f: (not f.injected, f.rank not in raisers, f.t))
        # The step as ctx.ping names it (the exception's), not the re-run machine's count.
        steps = [f.step for f in window if f.rank == v.rank and f.exc_type and f.step is not None]
        if v.kind.startswith("sdc:"):  # the step whose result was wrong, not the one it was found
            return v
        return replace(v, step=steps[0]) if steps else v
    own = [f for f in window if not f.in_collective]
    pool = own or window
    return min(pool, key=lambda f: (not f.injected, f.t))


def _finding(
    f: Fault,
    window: list[Fault],
    by_sig: dict[tuple[str, str, int | None], list[Fault]],
    *,
    several_hosts: bool,
) -> Finding:
    """Rules 0-3 and 5 (``attribute`` applies the recurrence rule, 4, to what is left)."""
    cls = classify(f)
    own = [g for g in window if not g.in_collective and not g.kind.startswith(("rerun:", "sdc:"))]
    ranks = sorted({g.rank for g in own})

    def found(origin: str, rule: str, evidence: list[Fault] | None = None) -> Finding:
        return _evidence(f, cls, origin, rule, evidence or [f], ranks, several_hosts=several_hosts)

    if f.injected:
        return found("injected", f"fired by the fault plan ({f.injected})")
    # A peer's broken collective says nothing of the fault's origin when a rank had its own.
    text = " ".join(f"{g.exc_type} {g.detail}" for g in (own or window))
    if STORAGE.search(text):
        return found("infrastructure", "storage error")
    if STORE.search(text):
        return found("infrastructure", "coordination store or network error")
    if not own and len({g.rank for g in window if g.in_collective}) >= 2:
        burst = [g for g in window if abs(g.t - f.t) <= BURST_S]
        return found("infrastructure", f"{len(burst)} ranks failed in collectives at once", burst)
    if f.kind == "unhealthy" or "persistent" in f.kind or HARDWARE.search(text):
        return found("hardware", "a failed health check, a GPU error or a persistent verdict")
    places = {(g.exc_type, g.where) for g in own}
    if len(ranks) >= 2 and len(places) == 1 and f.exc_type and f.where:
        return found("application", "every rank that faulted hit the same error at one place", own)
    same = by_sig.get(f.signature, [])
    if len({s.host for s in same if s.host}) >= 2 and f.exc_type:
        return found("application", "the same error at the same step on different hosts", same)
    if len({s.window for s in same}) >= 2 and f.kind == "exception" and f.exc_type and f.where:
        # Deterministic: the restart policy's max_same_fault stop calls this a bug too.
        rule = f"the same exception at the same place and step in {len(same)} windows"
        return found("application", rule, same)
    return found("unknown", "seen once, no evidence of an origin")


def _evidence(
    f: Fault,
    cls: str,
    origin: str,
    rule: str,
    evidence: list[Fault],
    ranks: list[int],
    *,
    several_hosts: bool,
) -> Finding:
    exclude = f"--exclude={f.host}" if origin == "hardware" and several_hosts and f.host else ""
    return Finding(
        f,
        cls,
        origin,
        rule,
        hosts=sorted({e.host for e in evidence if e.host}),
        steps=sorted({e.step for e in evidence}, key=_step_key),
        launches=sorted({e.launch for e in evidence}),
        exclude=exclude,
        ranks=ranks,
    )


def _step_key(step: int | None) -> int:
    return -1 if step is None else step
