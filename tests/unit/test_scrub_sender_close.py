"""A closed scrubbing sender ends its thread at once, even while it waits for a reserve's answer
that will not come: a thread left in the store's wait would return from C++ while the
interpreter finalises and abort the process ("terminate called without an active exception")."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from restartable.rerun.scrub_sender import Sender
from restartable.rerun.scrub_wire import Request, ScrubStore


def test_close_ends_a_wait_for_an_answer_that_never_comes() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def client() -> ScrubStore:
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)

    sender = Sender(client, timeout=60.0)  # no reserve: the answer would be awaited 60 s
    req = Request(
        step=5, rank=0, params={"w": torch.ones(2)}, batch=torch.zeros(1), rng=torch.zeros(1)
    )
    out = sender.submit(req, {"w": torch.ones(2)}, torch.tensor(1.0))
    assert out.done.wait(30) and out.seq is not None and not out.failed
    t0 = time.monotonic()
    sender.close()
    assert sender.join(10.0), "the sender thread still waits for the answer"
    assert time.monotonic() - t0 < 10.0
    assert out.answered.is_set() and out.answer is None  # closed: not judged, not an answer
