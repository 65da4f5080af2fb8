"""What a fault record's evidence says: counted or collateral, its repeat signature, the origin
its text names. Pure rules, shared by the live restart decision and the offline report.

``inprocess.protocol.policy`` (the decision every rank acts on) splits an iteration's faults
with ``classify`` and stops a deterministic repeat by ``signature`` unless ``text_origin`` names
the machine; ``inprocess.report.attribution`` (the report read after the job) names a fault's
origin by the same patterns. Both import this module; neither imports the other.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from restartable.inprocess.errors import FaultRecord

# Kinds that count as "this rank faulted" for max_rank_faults and the repeated-fault stop. A
# dead or hard-timed-out rank is retired at once, so it never needs counting.
OWN_FAULT_KINDS = frozenset({"exception", "soft_timeout", "section_timeout", "atomic_timeout"})

# Last resort only, for an exception that carries no structural evidence (e.g. user code caught
# a failed collective and raised its own error from it): how collectives fail when a peer went
# away (gloo, NCCL, the store).
PEER_LOST_MESSAGES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "DistNetworkError",
)


@dataclass(frozen=True)
class Collateral:
    """A fault the decision did not count: a consequence of another rank's fault."""

    fault: FaultRecord
    reason: str


def classify(
    faults: Sequence[FaultRecord], *, gone: frozenset[int] = frozenset()
) -> tuple[tuple[FaultRecord, ...], tuple[Collateral, ...]]:
    """Split one iteration's faults into the counted ones and the collateral ones.

    An exception is collateral when it is a consequence of another rank's fault, judged by what
    happened: it was raised by a collective (``in_collective``) while another rank has a fault
    of its own, or its process is gone, or the iteration had already faulted when it was
    recorded (``after_fault``). Only an exception without that structural evidence is matched
    by its message (``PEER_LOST_MESSAGES``), the last resort. An exception of the rank's own
    code always counts, and with nobody else to blame nothing is collateral: a collective that
    fails on every rank at once counts on every rank.
    """
    roots = [f for f in faults if _root_evidence(f) is None]
    counted: list[FaultRecord] = []
    collateral: list[Collateral] = []
    for f in faults:
        reason = _collateral_reason(f, roots, gone)
        if reason is None:
            counted.append(f)
        else:
            collateral.append(Collateral(f, reason))
    return tuple(counted), tuple(collateral)


def signature(counted: Sequence[FaultRecord]) -> tuple[tuple[Any, ...], ...]:
    """What must repeat for the repeated-fault stop: how, where and at which step ranks faulted.

    Not which rank: when every rank hits the same bug, which of them records it before the
    restart interrupts the others is a matter of timing, and the fault is the same.
    """
    return tuple(
        sorted(
            {
                (f.kind, f.exc_type, f.where, -1 if f.step is None else f.step)
                for f in counted
                if f.kind in OWN_FAULT_KINDS
            }
        )
    )


def _root_evidence(f: FaultRecord) -> str | None:
    """Why ``f`` may be a consequence of someone else's fault; None for a fault of its own.

    Only a failed communication can be caused by a peer: an exception raised by the rank's own
    code is its own fault, even when it came after another rank's (every rank hitting the same
    bug counts on every rank).
    """
    if f.kind != "exception":
        return None
    if f.in_collective:
        return "raised by a collective"
    matched = next((m for m in PEER_LOST_MESSAGES if m in f.detail), None)
    if matched is not None:
        return f"message contains {matched!r} (last resort: no structural evidence)"
    return None


def _collateral_reason(
    f: FaultRecord, roots: Sequence[FaultRecord], gone: frozenset[int]
) -> str | None:
    evidence = _root_evidence(f)
    if evidence is None:
        return None
    others = [g for g in roots if g.initial_rank != f.initial_rank]
    blame = [f"{g.label} on rank {g.initial_rank}" for g in others]
    blame += [f"rank {r} gone" for r in sorted(gone - {f.initial_rank})]
    if f.after_fault and not blame:  # the fault that ended the iteration is not recorded yet
        blame.append("the iteration had already faulted")
    if not blame:
        return None
    return f"{evidence}, after {', '.join(blame[:3])}"


# Error texts that name the machine rather than the code (a storage, store or network, or GPU
# error): a repeat of one of them is not called a bug, and the report gives them their origin.
STORAGE = re.compile(
    r"ENOSPC|No space left|EIO|Input/output error|Read-only file system|Disk quota|"
    r"CheckpointStorageError|Stale file handle",
    re.IGNORECASE,
)
STORE = re.compile(
    r"store unreachable|DistStoreError|StoreTimeoutError|TCPStore|Connection refused|"
    r"Network is unreachable|No route to host|etcd",
    re.IGNORECASE,
)
HARDWARE = re.compile(
    r"NVML|CUDA error|cudaError|Xid|ECC error|uncorrectable|illegal memory access|"
    r"GPU is lost|fallen off the bus",
    re.IGNORECASE,
)


def text_origin(text: str) -> str | None:
    """ "infrastructure" or "hardware" when an error's text names a storage, store, network or
    GPU error; None otherwise (the restart policy asks before it calls a repeat a bug)."""
    if STORAGE.search(text) or STORE.search(text):
        return "infrastructure"
    if HARDWARE.search(text):
        return "hardware"
    return None
