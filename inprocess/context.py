"""What ``train()`` sees of the restart: ``context()`` and the ``RestartContext`` it returns."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from restartable.inprocess import journal
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import ContextError
from restartable.inprocess.restart.progress import ProgressTracker

if TYPE_CHECKING:  # annotations only: the restart loop builds the context and imports them
    import torch.distributed as dist

    from restartable.inprocess.restart.interrupter import Interrupter
    from restartable.inprocess.timeouts.sections import SectionClock

# A ContextVar, not a global: each wrapped call sets and resets its own value.
_CURRENT: contextvars.ContextVar[RestartContext] = contextvars.ContextVar("inprocess_context")


@dataclass(frozen=True)
class RestartRecord:
    """The last restart as this rank saw it (also logged once per restart at INFO).

    ``phases``: seconds per phase: ``detect`` (fault recorded -> this rank noticed), ``abort``
    (process groups torn down), ``unwind`` (``train()`` left), ``barrier`` (restart barrier),
    ``reinit`` (join barrier and process group creation).
    """

    iteration: int
    cause: str
    faulting_ranks: tuple[int, ...]
    phases: dict[str, float]
    active_before: tuple[int, ...]
    active_after: tuple[int, ...]
    reserve_after: tuple[int, ...]


@dataclass
class RestartContext:
    """Handed to ``train()`` through ``inprocess.context()``; valid during one call only.

    ``rank``/``world_size``: this rank's place among the active ranks of this iteration.
    ``initial_rank``: its RANK at launch. ``active_ranks``: the initial rank of each active
    rank, in rank order. ``store``: a store namespace private to this iteration.
    """

    iteration: int
    rank: int
    world_size: int
    initial_rank: int
    active_ranks: tuple[int, ...]
    store: dist.Store
    last_restart: RestartRecord | None
    _progress: ProgressTracker = field(repr=False)
    _interrupter: Interrupter = field(repr=False)
    step: int | None = None
    _sections: SectionClock | None = field(default=None, repr=False)
    _clock: Clock = field(default=SYSTEM, repr=False)  # the restart loop's (demotion's wait)

    def ping(self, step: int | None = None) -> None:
        """Mark progress (optional: progress is detected automatically) and the current step.

        The step is what the repeated-fault stop compares: the same fault at the same step
        ``max_same_fault`` times in a row stops the job.
        """
        self._progress.stamp()
        if step is not None and step != self.step:
            self.step = step
            journal.record("step", step=step)  # the report's progress (cheap: see journal.py)

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block that a restart never interrupts half-way (e.g. a write that must not tear).

        A restart requested meanwhile is delivered when the block ends.
        """
        with self._interrupter.atomic():
            yield

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time a named part of ``train()``: ``"setup"``, ``"step"`` or ``"checkpointing"``.

        A section open longer than its timeout (``rank_section_timeouts[name]``, or the value
        computed with ``calculate_timeouts``) is a fault of this rank, recorded with the
        section's name, unless the rank is waiting on its peers inside a collective (then the
        hung peer is blamed). Code between sections is judged by
        ``rank_out_of_section_timeout``. Different sections may nest; a section opened inside
        itself, an unknown name or a call from another thread raise ``SectionError``. Code
        that opens no section keeps the soft timeout alone.
        """
        if self._sections is None:  # a context built without the loop's section clock
            yield
            return
        with self._sections.section(name):
            yield

    def section_timeouts(self) -> dict[str, tuple[float, str]]:
        """The limit each section would be judged by now: ``{name: (seconds, source)}``.

        ``source`` is "configured", "learned" or "stored" (from ``ft_state.json``); a section
        without a limit (nothing configured, nothing learned yet, in warm-up) is absent. Keys:
        ``setup``, ``step``, ``checkpointing``, ``out_of_section``.
        """
        if self._sections is None:
            return {}
        return self._sections.limits()

    def replace_rank(self, rank: int, *, reason: str, tag: str) -> bool:
        """Swap ``rank`` for a warm reserve now (a straggler): called by every active rank with
        the same arguments; False on every rank when no reserve is free, else a restart (see
        ``inprocess.restart.demotion.replace_rank``)."""
        from restartable.inprocess.restart.demotion import replace_rank  # it imports this module

        return replace_rank(self, rank, reason=reason, tag=tag, clock=self._clock)


def context() -> RestartContext:
    """The restart context of the running ``@restartable`` call (only inside ``train()``)."""
    try:
        return _CURRENT.get()
    except LookupError:
        raise ContextError(
            "restartable.inprocess.context() was called outside a @restartable function: call it "
            "inside the decorated train() (reserves and code after train() returned have no "
            "context)"
        ) from None


@contextlib.contextmanager
def activated(ctx: RestartContext) -> Iterator[RestartContext]:
    """Make ``ctx`` what ``context()`` returns inside the block (the wrapper's use)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
