"""One node's etcd member inside a Slurm allocation, as the child of its srun task: started on a
fresh node-local data directory, kept through a job-wide SIGTERM, stopped on request, cleaned.

Slurm delivers a preemption notice (``scancel --signal=TERM``, ``--signal=TERM@120``) to every
process of every step, etcd included, which shuts down on SIGTERM. The ranks need their store
most right then (they checkpoint and agree to stop), so a member that a SIGTERM ended is started
again on its data (every member gets the notice at once: the store pauses for about one start
and election, which the clients' retries cover). Only SIGUSR2 or SIGINT (the batch script's stop,
relayed by srun) stops the member for good: etcd is SIGKILLed and its data removed. SIGKILL of
the member itself at the job's end leaves the data directory, which the next attempt's member on
that node removes before it starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path
from types import FrameType

from restartable.inprocess.errors import ConfigError
from restartable.inprocess.etcd.allocation import INSTALL_HINT

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGINT)  # the batch script's "stop for good"
_MAX_RESTARTS = 5  # SIGTERMs survived in one job; beyond that something keeps killing it


class Member:
    """Runs ``argv`` (``AllocationCluster.member_argv``) on ``data_dir``; ``run()`` blocks until
    it is stopped (status 0) or ends on its own (its status, after a message)."""

    def __init__(self, argv: list[str], data_dir: Path) -> None:
        self.argv, self.data_dir = argv, data_dir
        self.stopping = False
        self.terms = 0  # job-wide SIGTERMs seen while etcd ran
        self._proc: subprocess.Popen[bytes] | None = None

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        # Not etcd's graceful stop: its data goes next, and a leader whose peers stopped first
        # spends seconds trying to hand its leadership over (seen here: 5 s).
        self._signal_child(signal.SIGKILL)

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        # etcd got the same SIGTERM from Slurm (it signals every process of the step).
        self.terms += 1

    def _signal_child(self, signum: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signum)

    def run(self) -> int:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGTERM, self._on_term)
        shutil.rmtree(self.data_dir, ignore_errors=True)  # a stale attempt's: start fresh
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            return self._supervise()
        finally:
            self._signal_child(signal.SIGKILL)
            shutil.rmtree(self.data_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.data_dir.parent.rmdir()  # the job's root, once no member's data is left

    def _supervise(self) -> int:
        restarts = 0
        while not self.stopping:
            terms = self.terms
            try:
                self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL)
            except OSError as exc:
                log.error("cannot start %s (%s): %s", self.argv[0], exc, INSTALL_HINT)
                return 2
            rc = self._wait()
            if self.stopping:
                log.info("etcd member %s stopped", self.data_dir.name)
                return 0
            if self.terms == terms or restarts >= _MAX_RESTARTS:
                log.error(
                    "etcd member %s ended with status %s (%d restarts after a SIGTERM): the "
                    "store has lost this member; its log is above",
                    self.data_dir.name,
                    rc,
                    restarts,
                )
                return rc if rc > 0 else 1
            restarts += 1
            log.warning(
                "etcd member %s ended on a job-wide SIGTERM (a preemption notice): started "
                "again on its data (%d/%d)",
                self.data_dir.name,
                restarts,
                _MAX_RESTARTS,
            )
        return 0  # stopped between two starts

    def _wait(self) -> int:
        assert self._proc is not None
        return self._proc.wait()  # the signal handlers run meanwhile (PEP 475 resumes it)


def node_name() -> str:
    """This node's Slurm name (``SLURMD_NODENAME``, set in every srun task)."""
    name = os.environ.get("SLURMD_NODENAME")
    if not name:
        raise ConfigError(
            "SLURMD_NODENAME is not set: run the etcd member as an srun task of the job "
            "(srun --ntasks-per-node=1 python -m restartable.inprocess.etcd member ...)"
        )
    return name
