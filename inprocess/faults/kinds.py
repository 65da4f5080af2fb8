"""The fault kinds (one table) and the act of each: what happens in this process when it fires."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import ConfigError

HANG_S = 24 * 3600.0  # long enough to be a hang for any job; the timeouts end it
SLOW_FACTOR = 3.0  # a `slow` rank's compute takes this many times as long (a throttled GPU)


@dataclass(frozen=True)
class Kind:
    """One fault kind.

    ``loses_rank``: the rank's process is gone afterwards, so a warm reserve must take its
    place. ``numeric``: the module does not fire it; the caller corrupts its own value (the loss)
    when told the fault is due. ``lasting``: firing it only records it; from then on the caller
    applies it to every step of this process (``slowdown``, ``burn``).
    """

    name: str
    description: str
    loses_rank: bool = False
    numeric: bool = False
    lasting: bool = False


KINDS: Mapping[str, Kind] = MappingProxyType(
    {
        k.name: k
        for k in (
            Kind("exception", "Python exception (InjectedFault): restart in place"),
            Kind("kill", "SIGKILL of the rank: a warm reserve takes its place", loses_rank=True),
            Kind("hang", "hang, GIL released: the soft timeout ends it"),
            Kind("hang_gil", "hang, GIL held: killed at the hard timeout", loses_rank=True),
            Kind("nan", "NaN loss, applied by the caller (the example re-runs it)", numeric=True),
            # Not loses_rank: the example handles SIGTERM (checkpoint, exit 75 on every rank).
            Kind("sigterm", "SIGTERM to the rank: a preemption notice where handled"),
            # Applied by the caller: only it knows which part of the step is compute.
            Kind(
                "slow",
                f"the rank's compute {SLOW_FACTOR:g}x slower from then on (a straggler)",
                lasting=True,
            ),
            # Silent data corruption (inprocess/faults/sdc.py): applied by the caller to a local
            # gradient, before the all-reduce averages it into every replica.
            Kind(
                "sdc",
                "one mantissa bit of one local gradient element flipped on every step from then "
                "on (a faulty chip)",
                lasting=True,
            ),
            Kind(
                "sdc-once",
                "one mantissa bit of one local gradient element flipped at that step (a transient)",
                numeric=True,
            ),
        )
    }
)

# The names inject() accepted before the table existed; tests and users still pass them.
ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "raise": "exception",
        "sigkill_self": "kill",
        "hang_gil_released": "hang",
        "hang_gil_held": "hang_gil",
        "sigterm_self": "sigterm",
    }
)


class InjectedFault(RuntimeError):
    """The exception an ``exception`` fault raises."""


def kind_of(name: str) -> Kind:
    """The kind called ``name`` (or one of its ``ALIASES``); ConfigError if there is none."""
    kind = KINDS.get(ALIASES.get(name, name))
    if kind is None:
        raise ConfigError(
            f"kind ({name!r}) must be one of {tuple(KINDS)} (or an alias: {tuple(ALIASES)}): "
            "pick a supported fault"
        )
    return kind


def kinds_help() -> str:
    """One line per kind, for ``--help`` texts."""
    width = max(len(name) for name in KINDS)
    return "\n".join(f"  {k.name:{width}}  {k.description}" for k in KINDS.values())


def act(kind: Kind, *, detail: str, clock: Clock = SYSTEM) -> None:
    """Make ``kind`` happen in this process now (returns only for ``sigterm`` with a handler).

    A ``numeric`` or ``lasting`` kind is the caller's to apply: asking for it is our bug.
    ``clock``: a ``hang`` sleeps on it.
    """
    assert not (kind.numeric or kind.lasting), f"{kind.name} is applied by the caller, not fired"
    if kind.name == "exception":
        raise InjectedFault(f"injected fault {detail}")
    if kind.name == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind.name == "hang":
        clock.sleep(HANG_S)
    elif kind.name == "hang_gil":
        # PyDLL keeps the GIL during the call: no Python thread of this process runs again. A
        # signal (the watchdog's SIGTERM) ends sleep() early; a frozen process would not wake
        # up, so sleep again (found by the fault matrix: the "hang" ended at the SIGTERM).
        libc = ctypes.PyDLL(None)
        while True:
            libc.sleep(int(HANG_S))
    elif kind.name == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        raise AssertionError(f"kind {kind.name} has no act")
