"""The checked rank's side of a reserve check: its request sent, and the reserve's answer
awaited, by a background thread.

The training thread only copies (the pre-step parameters and the local gradients, while they are
computed); the digest, the serialisation, the store write and the wait for the answer happen on
the sender thread, so a check never stalls the step on the network or on the reserve, and the
training thread makes no store round trip for it (on a machine the ranks share, each one wakes
the store's server and costs the step its scheduling delay). The wait is the store's own
(``wait``: no polling); the training thread reads the answer as an attribute.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from restartable.rerun.scrub_wire import (
    READY_KEY,
    SEQ_KEY,
    Answer,
    Request,
    ScrubStore,
    request_key,
    result_key,
)
from restartable.rerun.sdc_digest import digest

logger = logging.getLogger(__name__)

WITHDRAWN = b"withdrawn"  # what a closing sender writes as the answer it no longer awaits


@dataclass
class Outstanding:
    """A request of this rank, sent or being sent, and not yet judged."""

    request: Request
    sent_at: float = field(default_factory=time.monotonic)
    seq: int | None = None  # set by the sender thread once the request is in the store
    failed: str = ""  # why it could not be sent
    done: threading.Event = field(default_factory=threading.Event)  # sent, or failed
    answer: Answer | None = None  # the reserve's, once it came
    # Set when the answer came or will not: failed, or none within the sender's timeout.
    answered: threading.Event = field(default_factory=threading.Event)


class Sender:
    """One background thread with its own store client; ``submit`` returns at once. The thread
    sends each request, then waits (up to ``timeout`` seconds after the submit) for the
    reserve's answer before it takes the next request: a rank has one request outstanding at
    a time (``Judge.sends_now``)."""

    def __init__(self, make_store: Callable[[], ScrubStore], *, timeout: float) -> None:
        self._make_store = make_store
        self._timeout = timeout
        self._queue: queue.SimpleQueue[
            tuple[Outstanding, dict[str, torch.Tensor | None], torch.Tensor] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._reader: ScrubStore | None = None  # the training thread's (rank 0 asks: a reserve?)
        self._closing = threading.Event()
        self._waiting: int | None = None  # the request whose answer the thread waits for

    def submit(
        self, request: Request, grads: dict[str, torch.Tensor | None], loss: torch.Tensor
    ) -> Outstanding:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sdc-scrub-send", daemon=True)
            self._thread.start()
        out = Outstanding(request)
        self._queue.put((out, grads, loss.detach().clone()))
        return out

    def reader(self) -> ScrubStore:
        """The training thread's store client (created on first use)."""
        if self._reader is None:
            self._reader = self._make_store()
        return self._reader

    def _run(self) -> None:
        store: ScrubStore | None = None
        while (item := self._queue.get()) is not None:
            out, grads, loss = item
            try:
                out.request.digest = digest(grads, loss)
                store = store or self._make_store()
                seq = store.add(SEQ_KEY, 1)
                store.set(request_key(seq), out.request.encode())
                out.seq = seq
            except Exception as exc:
                out.failed = repr(exc)
                logger.warning(
                    "sdc scrubbing: request for step %d not sent: %r", out.request.step, exc
                )
                out.answered.set()
            finally:
                out.done.set()
            if store is not None and out.seq is not None:
                self._await_answer(store, out, out.seq)
        del store

    def _await_answer(self, store: ScrubStore, out: Outstanding, seq: int) -> None:
        """Block this thread until the answer to ``seq`` is in the store (bounded); a missing
        answer is the judge's to report (it counts the step unchecked)."""
        left = self._timeout - (time.monotonic() - out.sent_at)
        self._waiting = seq  # before the check: ``close`` either sees it or is seen here
        try:
            if left > 0 and not self._closing.is_set():
                store.wait([result_key(seq)], datetime.timedelta(seconds=left))
                if not self._closing.is_set():  # else the answer may be ``close``'s WITHDRAWN
                    out.answer = Answer.decode(store.get(result_key(seq)))
        except Exception as exc:  # the wait's timeout, or the store went away
            logger.debug("sdc scrubbing: no answer for request %d: %r", seq, exc)
        finally:
            self._waiting = None
            out.answered.set()

    def close(self) -> None:
        """End the thread and drop the training thread's store client; returns after one store
        write at most (``join`` waits for the thread). The store's wait cannot be interrupted,
        so the answer it waits for is written here (``WITHDRAWN``, never read: a closed
        sender's requests are judged no more): the thread then leaves its store call at once,
        instead of up to ``timeout`` seconds later, perhaps while the interpreter finalises
        (a daemon thread returning from C++ then aborts the process: std::terminate)."""
        if self._thread is not None and not self._closing.is_set():
            self._closing.set()
            self._queue.put(None)
            seq = self._waiting
            if seq is not None:
                with contextlib.suppress(Exception):  # the store went away: so did the wait
                    self.reader().set(result_key(seq), WITHDRAWN)
        self._reader = None

    def join(self, timeout: float) -> bool:
        """After ``close``: wait up to ``timeout`` s for the thread to end; whether it did."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()


class ReadyWatcher:
    """Whether a reserve serves checks, as rank 0 reports it at each sampled step, kept fresh
    by a thread of its own (one store read every ``interval`` seconds) instead of a store round
    trip on the training thread. The first read is made by the first ``serving`` call, on the
    caller's thread (so the job's first sampled step sees a reserve that is there)."""

    def __init__(self, make_store: Callable[[], ScrubStore], *, interval: float = 0.2) -> None:
        self._make_store, self._interval = make_store, interval
        self._seen = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def serving(self) -> bool:
        if self._thread is None:
            store = self._make_store()
            self._seen = _serving(store)
            self._thread = threading.Thread(
                target=self._run, args=(store,), name="sdc-scrub-ready", daemon=True
            )
            self._thread.start()
        return self._seen

    def _run(self, store: ScrubStore) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._seen = _serving(store)
            except Exception as exc:  # the store went away: no reserve can answer
                logger.debug("sdc scrubbing: cannot read whether a reserve serves: %r", exc)
                self._seen = False
                return

    def close(self) -> None:
        """Stop the thread (within ``interval``); returns at once."""
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """After ``close``: wait up to ``timeout`` s for the thread to end; whether it did."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()


def _serving(store: ScrubStore) -> bool:
    return store.add(READY_KEY, 0) > 0
