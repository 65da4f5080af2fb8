"""What re-running the current step needs: its RNG snapshot and its microbatches.

Owned by ``RerunStateMachine`` (``rerun.machine``), one per machine, used on the training loop's
thread from ``should_run_forward_backward`` (``begin``, ``new_step``, ``capture``, ``advance``,
``replay``) and from ``state_dict`` / ``load_state_dict`` (``data``, ``load``). Never blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rerun import data as data_mod
from rerun import rng
from rerun.data import RerunDataIterator


class StepReplay:
    """The data iterators of the step, the RNG snapshot taken before its first pass, and the
    microbatches of a re-run loaded from a checkpoint (None when there is none)."""

    def __init__(
        self,
        *,
        save_func: Callable[[], Any] | None,
        restore_func: Callable[[Any], None] | None,
    ) -> None:
        self._save_func, self._restore_func = save_func, restore_func
        self.iterators: list[RerunDataIterator] = []
        self.snapshot: rng.RngSnapshot | None = None
        self.loaded_data: list[list[Any]] | None = None  # microbatches of a pending re-run

    def begin(self, data: Any, *, required: bool, mode: str) -> None:
        """Take the step's data iterators (``should_run_forward_backward``'s ``data``)."""
        self.iterators = data_mod.as_iterators(data, required=required, mode=mode)

    def new_step(self) -> None:
        """A new step starts: a loaded re-run's microbatches are spent."""
        self.loaded_data = None

    def capture(self) -> None:
        """Snapshot the RNG state (and the extra state of ``state_save_func``)."""
        self.snapshot = rng.capture(self._save_func)

    def advance(self, *, record: bool) -> None:
        """Each iterator moves to the step's microbatches, recording them when ``record``."""
        for it in self.iterators:
            it.advance(record=record)

    def replay(self) -> None:
        """Restore the snapshot and rewind the iterators to the step's first microbatch."""
        if self.snapshot is not None:
            rng.restore(self.snapshot, self._restore_func)
        data_mod.replay(self.iterators, self.loaded_data)
        self.loaded_data = None

    def data(self) -> list[list[Any]]:
        """The step's microbatches per iterator, for a checkpoint of a pending re-run."""
        if self.loaded_data is not None:
            return self.loaded_data
        return [it.replay_buffer() for it in self.iterators]

    def load(self, snapshot: rng.RngSnapshot | None, data: list[list[Any]] | None) -> None:
        """A pending re-run restored from a checkpoint."""
        self.snapshot = snapshot
        self.loaded_data = data if data is not None else []
