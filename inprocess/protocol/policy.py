"""The restart decision: a pure function from what happened in an iteration to what happens next.

The wrapper gathers the inputs (the iteration's fault records and the ranks whose process is gone,
read from the store), keeps the history (the faults earlier decisions counted), calls
``decide`` and publishes its ``Decision``. Nothing here does I/O, reads a clock or keeps state.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol.fault_evidence import (
    OWN_FAULT_KINDS,
    Collateral,
    classify,
    signature,
    text_origin,
)
from restartable.inprocess.protocol.rank_runs import EncodedAssignment
from restartable.inprocess.protocol.ranks import (
    Assignment,
    NotEnoughRanksError,
    decode_ranks,
    encode_ranks,
    reassign,
)

# Kinds that remove a rank for good (besides its process being gone).
RETIRING_KINDS = frozenset({"unhealthy"})
# Kinds whose "demote" only swaps a slow but working rank for a reserve
# (inprocess.restart.demotion).
SWAP_ONLY_KINDS = frozenset({"straggler"})
# Collateral faults the published decision lists in full; the others are only counted
# (``collateral_omitted``). Every rank reads the decision, and when a fault releases every
# blocked collective at once, each rank may record one: listing them all would make the
# restart's bytes grow with the square of the job (docs/scale.md). The full list stays in
# the store (``it<n>/faults``) and in each recording rank's journal.
PUBLISHED_COLLATERAL = 8


@dataclass(frozen=True)
class Observed:
    """What the wrapper read from the store for one faulted iteration.

    ``faults``: every record of the iteration, in arrival order. ``gone``: initial ranks whose
    process is known to be gone (any iteration; the decision only looks at participants).
    ``joined``: respawned processes ready to join the reserve pool
    (``inprocess.protocol.job_keys``).
    """

    iteration: int
    faults: tuple[FaultRecord, ...]
    gone: frozenset[int] = frozenset()
    joined: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Retirement:
    """A rank the decision removed from the job for good, and why."""

    rank: int
    reason: str


@dataclass(frozen=True)
class Decision:
    """The outcome of one restart barrier; every rank of the job acts on the same one.

    ``counted``: the iteration's faults that are the rank's own (blamed, and kept in the history
    that ``max_rank_faults`` and ``max_same_fault`` look at). ``collateral``: the ones discarded,
    with the reason. ``retired``: ranks newly removed for good. ``demoted``: ranks sent to the
    back of the reserve pool. ``assignment``: the next iteration's roles, or None with ``stop``,
    the reason the job stops (every surviving rank raises ``RestartAbortedError`` with it).
    """

    iteration: int
    counted: tuple[FaultRecord, ...]
    collateral: tuple[Collateral, ...]
    retired: tuple[Retirement, ...]
    demoted: tuple[int, ...]
    assignment: Assignment | None
    stop: str | None
    collateral_omitted: int = 0  # collateral faults left out of the published form
    stop_origin: str = ""  # "application" when ``stop`` is a repeated exception of the code

    @property
    def faults(self) -> tuple[FaultRecord, ...]:
        """Every fault the decision saw, counted first."""
        return self.counted + tuple(c.fault for c in self.collateral)

    @property
    def faulting_ranks(self) -> tuple[int, ...]:
        """The initial ranks blamed for the iteration (collateral faults excluded)."""
        return tuple(sorted({f.initial_rank for f in self.counted}))

    def cause(self, limit: int = 4) -> str:
        """One line for logs: the counted faults, then how many were collateral."""
        text = "; ".join(
            f"{f.label}{f' ({f.section})' if f.section else ''} on rank {f.initial_rank}"
            for f in self.counted[:limit]
        )
        if len(self.counted) > limit:
            text += f"; +{len(self.counted) - limit} more"
        if self.collateral:
            ranks = sorted({c.fault.initial_rank for c in self.collateral})
            more = f" and {self.collateral_omitted} more" if self.collateral_omitted else ""
            text += f" (collateral, not counted: rank(s) {', '.join(map(str, ranks))}{more})"
        return text

    def to_json(self) -> str:
        """The form published in the store (first writer wins): its size does not grow with the
        job (rank lists as runs, at most ``PUBLISHED_COLLATERAL`` collateral faults)."""
        a = self.assignment
        return json.dumps(
            {
                "iteration": self.iteration,
                "counted": [_published(f) for f in self.counted],
                "collateral": [
                    {"fault": _published(c.fault), "reason": c.reason}
                    for c in self.collateral[:PUBLISHED_COLLATERAL]
                ],
                "collateral_omitted": self.collateral_omitted
                + max(0, len(self.collateral) - PUBLISHED_COLLATERAL),
                "retired": [[r.rank, r.reason] for r in self.retired],
                "demoted": list(self.demoted),
                # Runs of ranks (ranks.encode_ranks): every rank reads this document, so its
                # size must not grow with the job (docs/scale.md).
                "assignment": None
                if a is None
                else {
                    "active": encode_ranks(a.active),
                    "reserve": encode_ranks(a.reserve),
                    "retired": encode_ranks(sorted(a.retired)),
                },
                "stop": self.stop,
                **({"stop_origin": self.stop_origin} if self.stop_origin else {}),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Decision:
        """Inverse of ``to_json``."""
        d: dict[str, Any] = json.loads(text)
        a = d["assignment"]
        return cls(
            iteration=d["iteration"],
            counted=tuple(FaultRecord(**f) for f in d["counted"]),
            collateral=tuple(
                Collateral(FaultRecord(**c["fault"]), c["reason"]) for c in d["collateral"]
            ),
            retired=tuple(Retirement(r, why) for r, why in d["retired"]),
            demoted=tuple(d["demoted"]),
            assignment=None if a is None else _assignment(a),
            stop=d["stop"],
            collateral_omitted=int(d.get("collateral_omitted", 0)),
            stop_origin=str(d.get("stop_origin", "")),
        )


def _published(f: FaultRecord) -> dict[str, Any]:
    """A fault record as the decision carries it: its fields that differ from their default
    (every rank reads the decision: the defaults were ~100 of its ~460 bytes; ``from_json``
    restores them)."""
    default = {x.name: x.default for x in fields(FaultRecord) if x.default is not MISSING}
    return {k: v for k, v in asdict(f).items() if k not in default or v != default[k]}


def _ranks(value: str | list[int]) -> tuple[int, ...]:
    """A rank list of a published decision: runs (``encode_ranks``), or a list (older form)."""
    return decode_ranks(value) if isinstance(value, str) else tuple(value)


def _assignment(a: dict[str, Any]) -> Assignment:
    """A published assignment: runs are decoded on first use (``rank_runs``: every rank reads
    the decision, and a released rank needs its own place, not every rank's); lists (the older
    form) at once."""
    lists = a["active"], a["reserve"], a["retired"]
    if all(isinstance(x, str) for x in lists):
        return EncodedAssignment(*lists)
    return Assignment(
        active=_ranks(a["active"]),
        reserve=_ranks(a["reserve"]),
        retired=frozenset(_ranks(a["retired"])),
    )


@dataclass(frozen=True)
class DecisionInputs:
    """``decide``'s inputs but what the store holds at the moment of deciding (the ranks gone,
    the respawned ones ready to join), which the decider re-reads while it waits for respawns
    (``inprocess.protocol.capacity.decide_waiting``). Built by the deciding rank
    (``inprocess.restart.agreement``); ``faults`` are the iteration's records."""

    iteration: int
    faults: tuple[FaultRecord, ...]
    history: Sequence[Sequence[FaultRecord]]
    assignment: Assignment
    target: int
    node_of: Sequence[int]
    config: RestartConfig

    def decide(self, gone: frozenset[int], joined: frozenset[int]) -> Decision:
        """``decide`` with these ranks gone and these respawned identities ready to join."""
        return decide(
            Observed(self.iteration, self.faults, gone=gone, joined=joined),
            history=self.history,
            assignment=self.assignment,
            target=self.target,
            node_of=self.node_of,
            config=self.config,
        )


def decide(
    observed: Observed,
    *,
    history: Sequence[Sequence[FaultRecord]],
    assignment: Assignment,
    target: int,
    node_of: Sequence[int],
    config: RestartConfig,
) -> Decision:
    """The next assignment after ``observed.iteration`` faulted, or why the job stops.

    ``history``: the faults each earlier decision counted, oldest first (one entry per earlier
    restart). ``assignment``: the roles in the faulted iteration. ``target``: the active world
    size the job aims for. Stop rules, in order: the same fault ``max_same_fault`` times in a
    row, ``max_iterations`` reached, fewer healthy ranks than ``min_active_world_size``.
    A pure function: every rank that computes it from the same inputs gets the same Decision.
    """
    participants = set(assignment.active) | set(assignment.reserve)
    counted, collateral = classify(observed.faults, gone=observed.gone & participants)
    retired = _retirements(observed, counted, history, participants, config)
    lost = {r.rank for r in retired}
    demoted = _demotions(counted, lost, assignment)
    stop, stop_origin = _stop_rule(observed.iteration, counted, history, config)
    new: Assignment | None = None
    if stop is None:
        try:
            new = reassign(
                assignment,
                node_of=node_of,
                lost=sorted(lost),
                demoted=demoted,
                joined=sorted(observed.joined - observed.gone),
                granularity=config.granularity,
                active_world_size=target,
                min_active_world_size=min(config.min_active_world_size, target),
            )
        except NotEnoughRanksError as exc:
            stop, stop_origin = f"not enough healthy ranks to continue: {exc}", ""
    return Decision(
        iteration=observed.iteration,
        counted=counted,
        collateral=collateral,
        retired=retired,
        demoted=demoted,
        assignment=new,
        stop=stop,
        stop_origin=stop_origin,
    )


def _demotions(
    counted: Sequence[FaultRecord], lost: set[int], assignment: Assignment
) -> tuple[int, ...]:
    """Ranks to move to the reserve pool: those that asked, minus the lost ones.

    A swap (``SWAP_ONLY_KINDS``: a working but slow rank) is granted only while a healthy
    reserve is left to take its place after the lost active ranks took theirs: without one the
    rank would come straight back, and the restart would have bought nothing.
    """
    asked = sorted({f.initial_rank for f in counted if f.action == "demote"} - lost)
    swaps = {f.initial_rank for f in counted if f.kind in SWAP_ONLY_KINDS}
    free = len(set(assignment.reserve) - lost) - len(set(assignment.active) & lost)
    granted: list[int] = []
    for r in asked:
        if r in swaps:
            if free <= 0:
                continue
            free -= 1
        granted.append(r)
    return tuple(granted)


def _retirements(
    observed: Observed,
    counted: Sequence[FaultRecord],
    history: Sequence[Sequence[FaultRecord]],
    participants: set[int],
    config: RestartConfig,
) -> tuple[Retirement, ...]:
    """Ranks to remove for good: gone, unhealthy, asked to retire, or over ``max_rank_faults``."""
    why: dict[int, str] = {}
    for r in sorted(observed.gone & participants):
        why.setdefault(r, "its process is gone")
    for f in observed.faults:
        if f.kind in RETIRING_KINDS:
            why.setdefault(f.initial_rank, f"{f.kind}: {f.detail}")
    for f in counted:
        if f.action == "retire":
            why.setdefault(f.initial_rank, f"its exception asked to retire it ({f.exc_type})")
    if config.max_rank_faults is not None:
        per_rank: dict[int, set[int]] = {}
        for f in [*(g for faults in history for g in faults), *counted]:
            if f.kind in OWN_FAULT_KINDS:
                per_rank.setdefault(f.initial_rank, set()).add(f.iteration)
        for r, its in sorted(per_rank.items()):
            if len(its) > config.max_rank_faults:
                why.setdefault(
                    r,
                    f"faulted in {len(its)} iterations (max_rank_faults={config.max_rank_faults})",
                )
    return tuple(Retirement(r, reason) for r, reason in sorted(why.items()) if r in participants)


def _stop_rule(
    iteration: int,
    counted: Sequence[FaultRecord],
    history: Sequence[Sequence[FaultRecord]],
    config: RestartConfig,
) -> tuple[str | None, str]:
    """Why the job stops, or None; and "application" for a stop that is a bug of the code."""
    n = config.max_same_fault
    sigs = [signature(h) for h in history[-(n - 1) :]] if n > 1 else []
    last = signature(counted)
    if last and len(sigs) == n - 1 and all(s == last for s in sigs):
        own = next(f for f in counted if f.kind in OWN_FAULT_KINDS)
        return (
            f"the same fault repeated {n} times in a row (max_same_fault={n}): "
            f"{own.summary()}; fix the fault (or raise max_same_fault)",
            _repeated_origin(counted),
        )
    if config.max_iterations is not None and iteration + 1 >= config.max_iterations:
        return (
            f"max_iterations ({config.max_iterations}) reached: train() ran {iteration + 1} "
            "times and the last run faulted; raise max_iterations or fix the fault"
        ), ""
    return None, ""


def _repeated_origin(counted: Sequence[FaultRecord]) -> str:
    """ "application" when the repeated fault is an exception raised by the code at one place
    (type and ``file:line`` known) whose text names no storage, network or GPU error: the same
    exception at the same place and step on every restart is a bug, which a restart of the
    processes or a requeue of the job would hit again. "" otherwise (a hang or a death may be
    the machine's)."""
    own = [f for f in counted if f.kind in OWN_FAULT_KINDS]
    if not own or any(f.kind != "exception" or not f.exc_type or not f.where for f in own):
        return ""
    if any(text_origin(f"{f.exc_type} {f.detail}") for f in own):
        return ""
    return "application"
