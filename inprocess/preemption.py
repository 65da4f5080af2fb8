"""Preemption: turn a termination signal into "finish this step, checkpoint, exit".

Works in any training loop, with or without ``@restartable``::

    with PreemptionHandler(exit_signal=signal.SIGTERM, preempt_time=60.0) as preempt:
        for step in range(start, steps):
            train_step(step)
            if preempt.should_stop():        # collective when torch.distributed is initialised
                mgr.save(step + 1, state); mgr.wait()
                sys.exit(PREEMPTED_EXIT_CODE)

The launcher (``inprocess.launch``) and Slurm send the signal to every rank, but not at the same
instant, so ranks must agree on the step at which they stop: ``should_stop()`` all-reduces the
local flag (one tiny collective) and every rank gets the same answer at the same step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType, TracebackType

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.watchdog import kill_notice

log = logging.getLogger(__name__)

# Exit status of a rank (and of the launcher) that stopped for preemption after writing its
# checkpoint: EX_TEMPFAIL, "temporary failure, the user is invited to retry". Job scripts requeue
# on it; a finished job exits 0 and a failed one with another non-zero status.
PREEMPTED_EXIT_CODE = 75


class PreemptionHandler:
    """Owner of the handler of ``exit_signal``; restores the previous handler on ``close()``.

    Construct it in the main thread (Python only lets the main thread install signal handlers).
    ``preempt_time`` is the time the scheduler grants between the signal and the hard kill; it
    only informs ``seconds_left()`` and the log, the handler itself never sleeps.
    """

    def __init__(
        self,
        *,
        exit_signal: int = signal.SIGTERM,
        preempt_time: float = 60.0,
        clock: Clock = SYSTEM,
    ) -> None:
        if preempt_time <= 0:
            raise ValueError(
                f"preempt_time ({preempt_time}) must be > 0 s: set it to the time your "
                "scheduler grants between the signal and the kill (e.g. 60.0)"
            )
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionHandler must be created in the main thread (signal handlers can "
                "only be installed there): create it before starting worker threads"
            )
        self.exit_signal = signal.Signals(exit_signal)
        self.preempt_time = preempt_time
        self._clock = clock
        self._received_at: float | None = None
        self._previous = signal.signal(self.exit_signal, self._on_signal)
        self._closed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if kill_notice.posted(os.getpid()):
            # This rank's own watchdog is ending it (hard timeout): not the scheduler's notice,
            # which would stop every rank; the job goes on without this one.
            log.warning(
                "%s from this rank's hard-timeout watchdog: not a preemption",
                signal.Signals(signum).name,
            )
            return
        if self._received_at is None:
            self._received_at = self._clock.monotonic()
            log.warning(
                "received %s: finishing the current step, then checkpoint and exit "
                "(%.0f s granted)",
                self.exit_signal.name,
                self.preempt_time,
            )

    @property
    def received(self) -> bool:
        """True once this rank got the signal (local view; use should_stop() to decide)."""
        return self._received_at is not None

    def seconds_left(self) -> float | None:
        """Seconds until the scheduler's kill, or None when no signal arrived."""
        if self._received_at is None:
            return None
        return self.preempt_time - (self._clock.monotonic() - self._received_at)

    def should_stop(self) -> bool:
        """Whether every rank should stop after this step.

        Collective over the default process group when torch.distributed is initialised: every
        rank calls it at the same step and all get the same answer (True if any rank got the
        signal). Without torch.distributed it is the local flag.
        """
        import torch
        import torch.distributed as dist

        local = 1.0 if self.received else 0.0
        if not (dist.is_available() and dist.is_initialized()):
            return bool(local)
        # NCCL only reduces device tensors; gloo only host ones.
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([local], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        """Restore the previous handler. Idempotent."""
        if not self._closed:
            self._closed = True
            signal.signal(self.exit_signal, self._previous)

    def __enter__(self) -> PreemptionHandler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
