"""The hardware ledger: where this rank runs, what the latest verdict blamed, which hardware
had a persistent fault.

Owned by ``RerunStateMachine`` (``rerun.machine``), used on the training loop's thread of every
rank: ``check`` when a step begins, ``after`` each transition (a collective on the fault path:
every rank calls it at the same transition; nothing when no verdict and no re-run elsewhere).
The rest never blocks. ``faulty`` travels in ``state_dict`` so that a restarted job still
retires a rank on that hardware.
"""

from __future__ import annotations

import socket

import torch

from restartable.rerun import exits, verdicts
from restartable.rerun.errors import RerunExit
from restartable.rerun.record import StepRecord
from restartable.rerun.report import report_verdict
from restartable.rerun.state_machine import Diagnostic, State, Transition


def default_hardware_id() -> str:
    """``hostname:cuda:N`` (the current device, once CUDA is initialised) or ``hostname:cpu``."""
    dev = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_initialized() else "cpu"
    return f"{socket.gethostname()}:{dev}"


class HardwareLedger:
    """``id``: what "other hardware" compares (``hardware_id``, or the default read each time,
    since the current device may change after construction). ``verdict``: the latest verdict.
    ``suspects``: the ranks (and their hardware) that the latest verdict or pending re-run
    blames. ``faulty``: the hardware that persistent-fault verdicts named, in order, each once."""

    def __init__(self, hardware_id: str | None = None) -> None:
        self._hardware_id = hardware_id
        self.verdict: Diagnostic | None = None
        self.suspects = verdicts.Suspects()
        self.faulty: list[str] = []

    @property
    def id(self) -> str:
        return self._hardware_id or default_hardware_id()

    def check(self, *, retire: bool, iteration: int) -> None:
        """Before step ``iteration`` (or its re-run) begins: with ``retire`` (the machine's
        ``in_job``), raises ``RerunExit(retire)`` on hardware known to have had a persistent
        fault. Standalone, the persistent-fault verdict already ended the job."""
        if retire and self.id in self.faulty:
            raise exits.retired(self.id, self.suspects, iteration=iteration)

    def after(self, t: Transition, rec: StepRecord, *, iteration: int) -> None:
        """After the transition ``t`` of step ``iteration`` (``rec``): a verdict learns its
        suspects, remembers their hardware after a persistent fault and is reported (log and
        journal); a step that goes to other hardware learns its suspects. Collectives."""
        if t.verdict is not None:
            self.verdict = t.verdict
            self.suspects = verdicts.suspects_after(rec, t.state)
            if t.verdict is Diagnostic.PERSISTENT_ERROR:
                self.faulty += [h for h in self.suspects.hardware if h not in self.faulty]
            report_verdict(iteration, t.verdict, self.suspects)
        if t.state in (State.WILL_RERUN_ELSEWHERE, State.EXIT_RESUME_ELSEWHERE):
            self.suspects = verdicts.suspects_after(rec, t.state)

    def exit_exception(self, state: State, *, rank: int, iteration: int) -> RerunExit:
        """The ``RerunExit`` of the exit decision in ``state`` (not raised); see
        ``exits.decided``."""
        return exits.decided(
            state,
            self.verdict,
            rank=rank,
            hardware_id=self.id,
            suspects=self.suspects,
            iteration=iteration,
        )
