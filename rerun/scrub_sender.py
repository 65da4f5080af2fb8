"""The checked rank's side of a reserve check: its request sent by a background thread, and the
reserve's answer read later without blocking.

The training thread only copies (the pre-step parameters and the local gradients, while they are
computed); the digest, the serialisation and the store write happen on the sender thread, so a
check never stalls the step on the network or on the reserve.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from restartable.rerun.scrub_wire import (
    SEQ_KEY,
    Answer,
    Request,
    ScrubStore,
    peek,
    request_key,
    result_key,
)
from restartable.rerun.sdc_digest import digest

logger = logging.getLogger(__name__)


@dataclass
class Outstanding:
    """A request of this rank, sent or being sent, and not yet judged."""

    request: Request
    sent_at: float = field(default_factory=time.monotonic)
    seq: int | None = None  # set by the sender thread once the request is in the store
    failed: str = ""  # why it could not be sent
    done: threading.Event = field(default_factory=threading.Event)
    answer: Answer | None = None  # the reserve's, once judged


class Sender:
    """One background thread with its own store client; ``submit`` returns at once."""

    def __init__(self, make_store: Callable[[], ScrubStore]) -> None:
        self._make_store = make_store
        self._queue: queue.SimpleQueue[
            tuple[Outstanding, dict[str, torch.Tensor | None], torch.Tensor] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._reader: ScrubStore | None = None  # the training thread's client (peeks)

    def submit(
        self, request: Request, grads: dict[str, torch.Tensor | None], loss: torch.Tensor
    ) -> Outstanding:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sdc-scrub-send", daemon=True)
            self._thread.start()
        out = Outstanding(request)
        self._queue.put((out, grads, loss.detach().clone()))
        return out

    def answer(self, out: Outstanding) -> Answer | None:
        """The reserve's answer to ``out``, or None while there is none (never blocks)."""
        if out.seq is None:
            return None
        data = peek(self.reader(), result_key(out.seq))
        return None if data is None else Answer.decode(data)

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
            finally:
                out.done.set()
        del store

    def close(self) -> None:
        """End the thread and drop the store clients (their sockets close with them)."""
        self._reader = None
        if self._thread is not None:
            self._queue.put(None)
