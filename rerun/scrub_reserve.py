"""The reserve's side of scrubbing: a thread that re-computes the active ranks' sampled steps.

Started on a warm reserve while it waits (``Scrubber.serve``, e.g. as ``@restartable``'s
``prewarm``) and stopped when the process becomes active. It announces itself (``ready``), then
takes the requests in order (``seq``), each claimed once among the reserves, re-computes the
step on its own copy of the model from the request's parameters, batch and RNG state, and
answers with its digest. Its first request is computed twice: a step that is not bitwise
deterministic here answers ``NONDETERMINISTIC`` from then on (every check is then reported
unchecked, never a false positive). The thread runs at a lower CPU priority: where reserves and
active ranks share CPUs (a test machine), checks use the idle time, not the ranks'.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import torch

from restartable.rerun.scrub_wire import (
    READY_KEY,
    SEQ_KEY,
    Answer,
    Request,
    ScrubStore,
    claim_key,
    request_key,
    result_key,
)
from restartable.rerun.sdc_digest import Compute, recompute

logger = logging.getLogger(__name__)

NONDETERMINISTIC = "nondeterministic"
# Between looks for the next request (one store round trip, which wakes the store's server at
# normal priority: 50 a second, not 200; a check waits up to this long to be picked up).
POLL_S = 0.02
SKIP_AFTER_S = 5.0  # a numbered request that never arrived (its sender failed) is skipped
NICE = 19  # the checking thread's CPU priority where SCHED_IDLE is refused (Linux: per thread)


def lowest_priority() -> str:
    """Put the calling thread in the idle scheduling class (it runs only when no other thread
    of the machine wants the CPU), else at nice 19. Per thread on Linux: the process's other
    threads keep theirs. Returns what it set ("idle", "nice 19" or "" where neither works)."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, tid, NICE)
        return f"nice {NICE}"
    return ""


class ReserveChecker:
    """Serves checks from a thread until ``stop``. ``make_store``: a new store client (one
    per thread); ``make_model``: the model, built as the active ranks build theirs;
    ``compute(model, batch) -> loss``: the step's forward pass."""

    def __init__(
        self,
        *,
        make_store: Callable[[], ScrubStore],
        make_model: Callable[[], torch.nn.Module],
        compute: Compute,
        name: str,
    ) -> None:
        self._make_store, self._make_model, self._compute = make_store, make_model, compute
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.checks = 0
        self.seconds = 0.0  # total time spent checking (decode, compute, digest, answer)
        self.deterministic: bool | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sdc-scrub-reserve", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop taking requests (the process is about to train); returns at once."""
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """After ``stop``: wait up to ``timeout`` s for the thread to end (it ends after the
        check it may be computing); whether it did."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def _run(self) -> None:
        priority = lowest_priority() or "its normal priority"
        try:
            store = self._make_store()
            model = self._make_model()
            store.add(READY_KEY, 1)
            logger.info("sdc scrubbing: reserve %s serves checks (at %s)", self.name, priority)
            try:
                self._serve(store, model)
            finally:
                store.add(READY_KEY, -1)
        except Exception as exc:  # the store went away (the job ended) or a bad model factory
            if not self._stop.is_set():
                logger.warning("sdc scrubbing: reserve %s stopped serving: %r", self.name, exc)

    def _serve(self, store: ScrubStore, model: torch.nn.Module) -> None:
        nxt = store.add(SEQ_KEY, 0) + 1
        missing_since: float | None = None
        while not self._stop.is_set():
            if store.check([request_key(nxt)]):
                missing_since = None
                if store.add(claim_key(nxt), 1) == 1:
                    self._answer(store, model, nxt)
                nxt += 1
                continue
            if store.add(SEQ_KEY, 0) > nxt:  # later requests exist: this one may never come
                missing_since = missing_since or time.monotonic()
                if time.monotonic() - missing_since > SKIP_AFTER_S:
                    logger.warning("sdc scrubbing: request %d never arrived: skipped", nxt)
                    nxt, missing_since = nxt + 1, None
                    continue
            self._stop.wait(POLL_S)

    def _answer(self, store: ScrubStore, model: torch.nn.Module, seq: int) -> None:
        t0 = time.perf_counter()
        req = Request.decode(store.get(request_key(seq)))
        store.delete_key(request_key(seq))
        got = recompute(model, self._compute, req.batch, req.rng, req.params)
        if self.deterministic is None:
            again = recompute(model, self._compute, req.batch, req.rng, req.params)
            self.deterministic = again == got
            if not self.deterministic:
                logger.error(
                    "sdc scrubbing: the step is not bitwise deterministic on reserve %s (two "
                    "re-computations of step %d differ): its checks answer 'unchecked'; make "
                    "the step deterministic (torch.use_deterministic_algorithms) to scrub",
                    self.name,
                    req.step,
                )
        if not self.deterministic:
            got = NONDETERMINISTIC
        seconds = time.perf_counter() - t0
        store.set(result_key(seq), Answer(got, self.name, seconds).encode())
        self.checks += 1
        self.seconds += seconds
        logger.debug(
            "sdc scrubbing: checked step %d of rank %d in %.4f s", req.step, req.rank, seconds
        )
