"""The exceptions of the ``inprocess`` package: one base class, and the restart signal."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Exceptions that report a numerical fault (NaN/Inf, a loss spike, a result that did not
# reproduce): a float error, or a re-run verdict handed to the restart (``rerun.errors``).
# Matched as a suffix (is_numerical): also the name journals written before the packages moved
# under ``restartable.`` (issue 47) hold.
NUMERICAL_EXC_TYPES = ("FloatingPointError", "rerun.errors.RerunExit")  # names: keep


def is_numerical(exc_type: str) -> bool:
    """True when an exception of type ``exc_type`` (``module.QualName``) is a numerical fault."""
    return any(exc_type == t or exc_type.endswith("." + t) for t in NUMERICAL_EXC_TYPES)


@dataclass(frozen=True)
class FaultRecord:
    """One fault of one rank in one restart iteration, as stored in the coordination store.

    ``kind`` is one of "exception", "soft_timeout", "dead", "hard_timeout", "unhealthy" (others
    may be added). ``exc_type``/``where``/``step``/``action`` are filled in for exceptions raised
    out of ``train()``: the exception class, the ``file:line`` of the raise, the last step the
    user reported (``ctx.step``) and a rank action ("demote"/"retire") the exception asked for.
    ``in_collective``: the exception was raised by a collective (a peer's fault breaks those);
    ``after_fault``: the iteration had already faulted when it was recorded. The restart policy
    uses both to tell a rank's own fault from the consequence of another rank's. ``section``:
    the section (``ctx.section(name)``) that overran its timeout, for kind "section_timeout".
    """

    iteration: int
    initial_rank: int
    kind: str
    detail: str
    exc_type: str = ""
    where: str = ""
    step: int | None = None
    action: str = ""
    time: float = 0.0  # time.time() when the fault was recorded (same-host latency accounting)
    in_collective: bool = False
    after_fault: bool = False
    section: str = ""

    @property
    def label(self) -> str:
        """The fault's name in restart lines, reports and attribution alike: its ``kind``, but
        "numerical" for an exception that reports a numerical fault (``is_numerical``); the
        restart policy keeps reading ``kind``."""
        if self.kind == "exception" and self.exc_type.endswith(".SilentDataCorruption"):
            return "sdc"  # rerun.scrub found a wrong result on this rank
        return (
            "numerical" if self.kind == "exception" and is_numerical(self.exc_type) else self.kind
        )

    def summary(self) -> str:
        """One line for logs and error messages."""
        at = f" at {self.where}" if self.where else ""
        at += f" in section {self.section!r}" if self.section else ""
        step = f" (step {self.step})" if self.step is not None else ""
        return (
            f"iteration {self.iteration}: rank {self.initial_rank} {self.label}{step}{at}: "
            f"{self.detail}"
        )


class InprocessError(Exception):
    """Base class of every error the ``inprocess`` package raises on purpose."""


class ConfigError(InprocessError, ValueError):
    """A configuration value is invalid; the message names field, value, rule and fix."""


class ContextError(InprocessError, RuntimeError):
    """``inprocess.context()`` was called outside a ``@restartable`` function."""


class SectionError(InprocessError, RuntimeError):
    """``ctx.section(name)`` misused: an unknown name, a section opened inside itself, or a call
    from a thread other than the one running ``train()``."""


class StoreTimeoutError(InprocessError, TimeoutError):
    """A barrier or wait on the coordination store did not complete within its bound."""


class RestartAbortedError(InprocessError):
    """The job stopped restarting: raised on every surviving rank with the fault history.

    Causes: ``max_iterations`` reached, the same fault repeated ``max_same_fault`` times, not
    enough healthy ranks left, or a rank that left the job. ``history`` lists every fault seen.
    """

    def __init__(
        self, message: str, history: Sequence[FaultRecord] = (), *, origin: str = ""
    ) -> None:
        self.history: tuple[FaultRecord, ...] = tuple(history)
        # "application": the stop is a bug in the code (the same exception at the same place
        # and step every time): neither an in-job restart nor a requeue would get past it.
        self.origin = origin
        lines = [message]
        if self.history:
            lines.append("fault history:")
            lines.extend(f"  {r.summary()}" for r in self.history)
        super().__init__("\n".join(lines))
        self.reason = message


class RestartInterrupt(BaseException):
    """Raised inside ``train()`` (from the monitor thread) to unwind it for a restart.

    A ``BaseException`` so that ``except Exception`` in user code does not swallow it. User code
    should let it propagate; ``finally`` blocks and context managers run as usual.
    """
