"""What a step recorded: the validation calls of the current pass and the rejected call.

Flags of the initial run stay on their device until ``read_initial``, which makes the step's
single device-to-host read (after the cross-rank reduction of the same tensor).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from restartable.rerun import agree, tracker
from restartable.rerun.checks import Rejection, Value, as_float
from restartable.rerun.state_machine import Flag


@dataclass
class Rejected:
    """The call that was rejected on this rank: matched on re-runs by (message, seq)."""

    message: str
    seq: int  # the n-th call with this message in the step
    fatal: bool
    tolerance: float
    initial: float  # the rejected result


class StepRecord:
    """Per-rank memory of one step (``new_step``) and of its current pass (``new_pass``)."""

    def __init__(self) -> None:
        self.rejected: Rejected | None = None
        self.suspect_hw = ""  # the hardware where a fatal rejection reproduced
        self.first_results: dict[tuple[str, int], float] = {}  # determinism stats mode
        self.seq: dict[str, int] = {}
        self.calls: list[tuple[str, int, bool, float, Value]] = []
        self.tensor_flags: list[tuple[int, torch.Tensor]] = []
        self.host_rejected: list[int] = []
        self.rerun_diff: float | None = None
        self.rerun_result = math.nan

    def resume(self, rejected: Rejected | None, suspect_hw: str) -> None:
        """A pending re-run restored from a checkpoint: the call to compare, and where it
        reproduced."""
        self.rejected = rejected
        self.suspect_hw = suspect_hw

    def new_step(self) -> None:
        self.rejected = None
        self.suspect_hw = ""
        self.first_results = {}
        self.new_pass()

    def new_pass(self) -> None:
        self.seq = {}
        self.calls = []
        self.tensor_flags = []
        self.host_rejected = []
        self.rerun_diff = None
        self.rerun_result = math.nan

    def next_seq(self, message: str) -> int:
        seq = self.seq.get(message, 0)
        self.seq[message] = seq + 1
        return seq

    def add_initial(
        self, message: str, seq: int, fatal: bool, tolerance: float, value: Value, flag: Rejection
    ) -> None:
        index = len(self.calls)
        self.calls.append((message, seq, fatal, tolerance, value))
        if isinstance(flag, torch.Tensor):
            self.tensor_flags.append((index, flag))
        elif flag:
            self.host_rejected.append(index)

    def add_rerun(
        self, message: str, seq: int, value: Value, comparison: Callable[[float, float], float]
    ) -> None:
        r = self.rejected
        if r is not None and (message, seq) == (r.message, r.seq):
            self.rerun_result = as_float(value)
            self.rerun_diff = comparison(r.initial, self.rerun_result)

    def reproduced(self) -> bool:
        """The rejected call ran again within tolerance (a call that did not run: no)."""
        r = self.rejected
        return r is not None and self.rerun_diff is not None and self.rerun_diff <= r.tolerance

    def read_initial(self, device: torch.device) -> frozenset[Flag]:
        """Agree on ``REJECTED`` over ranks and note this rank's first rejected call.

        ``device`` is where the default group reduces; one collective, one read.
        """
        if not self.tensor_flags and not agree.is_distributed():
            # Every flag is already on the host and nobody to agree with: no tensor work at all.
            return self._note_rejected(self.host_rejected, frozenset())
        # After an initial run only REJECTED can be set: the ranks agree on that one element,
        # not on the whole flag vector. On gloo a MAX all-reduce of the 6-flag vector is cut into
        # segments sent in several messages; one element costs the fewest wake-ups per step.
        local = torch.zeros(1, dtype=torch.int32, device=device)
        if self.host_rejected:
            local.fill_(1)
        flags = None
        if self.tensor_flags:
            # Stack where the flags live, then move once: one copy (one sync) at most.
            first = self.tensor_flags[0][1].device
            flags = torch.stack(
                [f.reshape(()).to(first, torch.int32) for _, f in self.tensor_flags]
            ).to(local.device)
            local[0] = torch.maximum(local[0], flags.max())
        agree.reduce_max_(local)
        host = (torch.cat([local, flags]) if flags is not None else local).tolist()
        rejected = sorted(
            self.host_rejected
            + [idx for (idx, _), v in zip(self.tensor_flags, host[1:], strict=True) if v]
        )
        return self._note_rejected(rejected, frozenset({Flag.REJECTED}) if host[0] else frozenset())

    def _note_rejected(self, rejected: list[int], agreed: frozenset[Flag]) -> frozenset[Flag]:
        if not rejected:
            return agreed
        # Prefer a fatal rejection: it decides whether the job must stop.
        idx = next((i for i in rejected if self.calls[i][2]), rejected[0])
        message, seq, fatal, tol, value = self.calls[idx]
        self.rejected = Rejected(message, seq, fatal, tol, as_float(value))
        return agreed | {Flag.REJECTED}

    def rerun_outcome(self, *, in_place: bool, hardware_id: str) -> tuple[Flag | None, str]:
        """This rank's flag after a re-run, and the tracker status to record ("" for none).

        Only the rank that rejected a result contributes. In place, a fatal rejection that
        reproduced makes this hardware the suspect. Elsewhere, landing on the suspect hardware
        again decides nothing (``SAME_HARDWARE``: resume elsewhere again).
        """
        r = self.rejected
        if r is None:
            return None, ""
        same = self.reproduced()
        if in_place:
            status = (
                tracker.FIRST_RERUN_REPRODUCIBLE if same else tracker.FIRST_RERUN_NOT_REPRODUCIBLE
            )
            if not r.fatal:
                return None, status
            if same:
                self.suspect_hw = hardware_id
                return Flag.FATAL_REPRODUCED, status
            return Flag.FATAL_NOT_REPRODUCED, status
        if hardware_id == self.suspect_hw:
            return Flag.SAME_HARDWARE, ""
        if same:
            return Flag.SAME_ELSEWHERE, tracker.SECOND_RERUN_REPRODUCIBLE
        return Flag.DIFFERS_ELSEWHERE, tracker.SECOND_RERUN_NOT_REPRODUCIBLE
