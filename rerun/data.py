"""``RerunDataIterator``: replays the exact microbatches of a step when the step is re-run."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from restartable.rerun.errors import RerunConfigError


class RerunDataIterator:
    """Wraps the training data iterator so that a re-run of a step sees the same microbatches.

    The state machine drives it (the training loop only calls ``next``): at the start of a step
    it forgets the previous step's microbatches and, when validation is on, keeps a reference to
    each one it yields; on a re-run it replays them from the first. References only, no copies:
    a microbatch must not be modified in place by the step (the usual case; a loader yields fresh
    tensors each time).
    """

    def __init__(self, iterable: Iterable[Any]) -> None:
        self._it: Iterator[Any] = iter(iterable)
        self._saved: list[Any] = []
        self._recording = False
        self._replaying = False
        self._pos = 0

    def __iter__(self) -> RerunDataIterator:
        return self

    def __next__(self) -> Any:
        if self._replaying:
            if self._pos < len(self._saved):
                item = self._saved[self._pos]
                self._pos += 1
                return item
            # The re-run asks for more microbatches than the first run did: read on, keep them.
            self._replaying = False
        item = next(self._it)
        if self._recording:
            self._saved.append(item)
            self._pos = len(self._saved)
        return item

    # -- driven by RerunStateMachine -------------------------------------------------------

    def advance(self, *, record: bool) -> None:
        """Start a new step: drop the previous step's microbatches; keep new ones if ``record``."""
        self._saved = []
        self._recording = record
        self._replaying = False
        self._pos = 0

    def rewind(self) -> None:
        """Replay this step's microbatches from the first."""
        self._replaying = True
        self._pos = 0

    def replay_buffer(self) -> list[Any]:
        """The microbatches of the current step (for the checkpoint of a pending re-run)."""
        return list(self._saved)

    def load_replay_buffer(self, saved: list[Any]) -> None:
        """Replay ``saved`` (from a checkpoint) before reading the wrapped iterator again."""
        self._saved = list(saved)
        self._recording = True
        self._replaying = True
        self._pos = 0


def as_iterators(data: Any, *, required: bool, mode: str) -> list[RerunDataIterator]:
    """The ``RerunDataIterator`` s in ``data`` (None, one, or a list; Nones are skipped).

    With ``required`` (a mode that may re-run a step) any other iterator is an error: its
    microbatches could not be replayed.
    """
    out = []
    for it in data if isinstance(data, list) else [data]:
        if isinstance(it, RerunDataIterator):
            out.append(it)
        elif it is not None and required:
            raise RerunConfigError(
                f"data ({type(it).__name__}) must be a RerunDataIterator (or a list of them) "
                f"when mode is {mode}: wrap it, data = RerunDataIterator(loader)"
            )
    return out


def replay(iterators: Sequence[RerunDataIterator], loaded: list[list[Any]] | None) -> None:
    """Rewind each iterator, or make it replay ``loaded`` microbatches from a checkpoint."""
    if loaded is None:
        for it in iterators:
            it.rewind()
        return
    if len(loaded) != len(iterators):
        raise RerunConfigError(
            f"the checkpoint holds microbatches of {len(loaded)} data iterator(s) but "
            f"should_run_forward_backward got {len(iterators)}: pass the same iterators as the "
            "job that saved it"
        )
    for it, saved in zip(iterators, loaded, strict=True):
        it.load_replay_buffer(saved)
