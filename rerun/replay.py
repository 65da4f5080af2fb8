"""What re-running the current step needs: its RNG snapshot and its microbatches.

Owned by ``RerunStateMachine`` (``rerun.machine``), one per machine, used on the training loop's
thread from ``should_run_forward_backward`` (``begin``, ``start_step``, ``capture``,
``replay``) and from ``state_dict`` / ``load_state_dict`` (``data``, ``load``). Never blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from restartable.rerun import data as data_mod
from restartable.rerun import rng
from restartable.rerun.data import RerunDataIterator
from restartable.rerun.state_machine import RerunMode


class StepReplay:
    """The data iterators of the step, the RNG snapshot taken before its first pass, and the
    microbatches of a re-run loaded from a checkpoint (None when there is none)."""

    def __init__(
        self,
        mode: RerunMode,
        *,
        save_func: Callable[[], Any] | None,
        restore_func: Callable[[Any], None] | None,
    ) -> None:
        """``mode``: the machine's (every mode but ``disabled`` requires the step's data)."""
        self._mode = mode
        self._save_func, self._restore_func = save_func, restore_func
        self.iterators: list[RerunDataIterator] = []
        self.snapshot: rng.RngSnapshot | None = None
        self.loaded_data: list[list[Any]] | None = None  # microbatches of a pending re-run

    def begin(self, data: Any) -> None:
        """Take the step's data iterators (``should_run_forward_backward``'s ``data``)."""
        required = self._mode is not RerunMode.DISABLED
        self.iterators = data_mod.as_iterators(data, required=required, mode=self._mode.value)

    def start_step(self, *, capture: bool) -> None:
        """A new step starts: a loaded re-run's microbatches are spent; with ``capture`` the RNG
        is snapshot before the step's first pass and the iterators record its microbatches."""
        self.loaded_data = None
        if capture:
            self.capture()
        for it in self.iterators:
            it.advance(record=capture)

    def capture(self) -> None:
        """Snapshot the RNG state (and the extra state of ``state_save_func``)."""
        self.snapshot = rng.capture(self._save_func)

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
