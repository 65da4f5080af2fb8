"""Reserve scrubbing's bookkeeping on the active ranks: which rank sends which step, the reserve's
answers turned into verdicts every rank agrees on, and the newest verified step of each rank.

At each sampled step every active rank takes part in ONE MAX all-reduce of ``1 + world`` ints:
whether a reserve serves checks (rank 0's watcher thread looks in the store) and, per rank, what
became of its outstanding request (pending, passed, unchecked, mismatch). Each rank reads only its
own answer, without blocking. The all-reduce is started before the step's forward pass
(``launch``) and read after its backward pass (``collect``): it travels while the step computes,
so the ranks do not meet for it (a blocking one cost every sampled step the ranks' arrival skew,
about 5 ms here, docs/rerun.md), and every rank still acts on the same verdict at the same step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from restartable.rerun import agree
from restartable.rerun.scrub_reserve import NONDETERMINISTIC
from restartable.rerun.scrub_rollback import Snapshots
from restartable.rerun.scrub_sender import Outstanding, ReadyWatcher, Sender
from restartable.rerun.scrub_wire import READY_KEY, Request, ScrubStore

logger = logging.getLogger(__name__)

PENDING, PASSED, UNCHECKED, MISMATCH = 0, 1, 2, 3


@dataclass(frozen=True)
class Mismatch:
    """Rank ``rank``'s step ``step`` re-computed by a reserve with another result; ``mine``:
    the request, on the rank that sent it (None elsewhere)."""

    rank: int
    step: int
    mine: Outstanding | None


class Judge:
    """One per ``train()`` call (``resume`` carries what outlives a restart)."""

    def __init__(
        self, make_store: Callable[[], ScrubStore], *, rank: int, world: int, timeout: float
    ) -> None:
        self.sender = Sender(make_store, timeout=timeout)
        self.rank, self.world, self.timeout = rank, world, timeout
        self.ready = False
        self.was_ready = False  # may_send() when the sampled step being judged began
        self.outstanding: list[int | None] = [None] * world  # the step each rank's request is of
        self.last_passed: list[int | None] = [None] * world
        self.mine: Outstanding | None = None
        self.first: int | None = None  # the first checked step (the job's copies start there)
        self.sent = self.passed = self.unchecked = 0
        self._flight: tuple[torch.Tensor, agree.Pending, bool] | None = None  # launch's reduce
        self._watcher = ReadyWatcher(make_store) if rank == 0 else None

    def resume(self, old: Judge | None, snaps: Snapshots) -> None:
        """COLLECTIVE. Carry the verified steps over a restart; a rank new to the job (a
        reserve that took a retired rank's place) learns them from the others."""
        if old is not None and old.world == self.world:
            self.last_passed = list(old.last_passed)
            self.ready, self.first = old.ready, old.first
            self.sent, self.passed, self.unchecked = old.sent, old.passed, old.unchecked
            old.close()
        vec = torch.tensor(
            [
                int(self.ready),
                -1 if self.first is None else self.first,
                *(-1 if s is None else s for s in self.last_passed),
            ],
            dtype=torch.int64,
            device=agree.comm_device(),
        )
        agree.reduce_max_(vec)
        values = [int(v) for v in vec.tolist()]
        self.ready = bool(values[0])
        self.first = None if values[1] < 0 else values[1]
        self.last_passed = [None if v < 0 else v for v in values[2:]]

    def wait_ready(self, timeout: float) -> bool:
        """COLLECTIVE: rank 0 waits (bounded) for a serving reserve; every rank learns it."""
        flag = torch.zeros(1, dtype=torch.int64, device=agree.comm_device())
        if self.rank == 0:
            end = time.monotonic() + timeout
            while not self._peek_ready() and time.monotonic() < end:
                time.sleep(0.05)
            flag[0] = int(self._peek_ready())
        agree.reduce_max_(flag)
        self.ready = bool(flag.item())
        return self.ready

    def checked_rank(self, step: int, every: int) -> int:
        """Rotating, rank 0 first at step ``every`` (step 0 is not checked in the example)."""
        return (step // every - 1) % self.world

    def sends_now(self, step: int, every: int) -> bool:
        """Whether step ``step``'s checked rank sends it (once per sampled step, after
        ``collect``; every rank calls it): a reserve served when the step began (its copies
        were taken then) and still does, and that rank's previous request is judged."""
        rank = self.checked_rank(step, every)
        if not (self.ready and self.was_ready) or self.outstanding[rank] is not None:
            return False
        self.outstanding[rank] = step
        self.sent += 1
        self.first = step if self.first is None else self.first
        return True

    def submit(
        self, req: Request, grads: dict[str, torch.Tensor | None], loss: torch.Tensor
    ) -> None:
        self.mine = self.sender.submit(req, grads, loss)

    def rollback_target(self, rank: int) -> int:
        """Where a persistent fault of ``rank`` sends the job: its newest verified step, or
        the first checked step while it has none (the same on every rank)."""
        passed = self.last_passed[rank]
        return passed if passed is not None else (self.first or 0)

    def oldest_needed(self) -> int:
        """The oldest step a finding may still roll back to."""
        return min(self.rollback_target(r) for r in range(self.world))

    def launch(self, step: int, every: int) -> None:
        """COLLECTIVE (started, not awaited), before each sampled step's forward pass: this
        rank's view of the answers goes into the all-reduce that ``collect`` reads.

        Back-pressure: when it is this rank's turn again and the reserve has not answered its
        previous request yet, this rank waits for the answer (bounded by ``timeout``), so a
        reserve that falls a whole rotation behind slows the job instead of leaving steps
        unchecked."""
        if self.mine is not None and self.ready and self.checked_rank(step, every) == self.rank:
            left = self.mine.sent_at + self.timeout - time.monotonic()
            self.mine.answered.wait(max(left, 0.0))
        vec = torch.zeros(1 + self.world, dtype=torch.int64, device=agree.comm_device())
        if self._watcher is not None:
            vec[0] = int(self._watcher.serving())
        if self.mine is not None:
            vec[1 + self.rank] = self._code(self.mine)
        self._flight = (vec, agree.reduce_max_async(vec), self.may_send())

    def may_send(self) -> bool:
        """Before a sampled step (the same on every rank): whether its checked rank may send
        it, so that it and the next rank take their copies. A reserve served at the last
        verdict, or no check was sent yet (the first verdict may find one)."""
        return self.ready or self.first is None

    def collect(self) -> list[Mismatch]:
        """COLLECTIVE, after the backward pass of a step ``launch`` was called for: agree on
        the answers (waits for the all-reduce, normally long done); returns the mismatches."""
        assert self._flight is not None, "collect() without launch(): call launch first"
        vec, pending, self.was_ready = self._flight
        self._flight = None
        pending.wait()
        values = [int(v) for v in vec.tolist()]
        if bool(values[0]) != self.ready:
            logger.info(
                "sdc scrubbing: %s",
                "a reserve serves checks: every rank is checked from now"
                if values[0]
                else "no reserve serves checks any more: unchecked until one does",
            )
        self.ready = bool(values[0])
        found = []
        for rank, got in enumerate(values[1:]):
            sent = self.outstanding[rank]
            if sent is None or (got == PENDING and self.ready):
                continue
            code, step = got or UNCHECKED, sent  # PENDING without a reserve: none will answer
            self.outstanding[rank] = None
            mine, self.mine = (self.mine, None) if rank == self.rank else (None, self.mine)
            if code == PASSED:
                self.last_passed[rank] = step
                self.passed += 1
            elif code == UNCHECKED:
                self.unchecked += 1
                logger.warning("sdc scrubbing: step %d of rank %d went unchecked", step, rank)
            else:
                found.append(Mismatch(rank, step, mine))
        return found

    def after_finding(self, rank: int, *, persistent: bool, target: int) -> None:
        """The run goes back to ``target``: no newer step is verified; a retired rank's place
        is filled by a process that starts there."""
        self.last_passed = [None if s is None else min(s, target) for s in self.last_passed]
        if persistent:
            self.last_passed[rank] = target

    def close(self) -> None:
        self.sender.close()  # and its store clients
        if self._watcher is not None:
            self._watcher.close()

    def join(self, timeout: float) -> bool:
        """After ``close``: wait up to ``timeout`` s in all for the threads; whether they ended."""
        end = time.monotonic() + timeout
        ended = self.sender.join(timeout)
        if self._watcher is not None:
            ended = self._watcher.join(max(0.0, end - time.monotonic())) and ended
        return ended

    def _peek_ready(self) -> bool:
        return self.sender.reader().add(READY_KEY, 0) > 0

    def _code(self, out: Outstanding) -> int:
        if out.failed:
            return UNCHECKED
        answer = out.answer  # the sender thread's, once it came (no store round trip here)
        if answer is None:
            late = time.monotonic() - out.sent_at > self.timeout
            if late:
                logger.warning(
                    "sdc scrubbing: no answer for step %d in %.0f s", out.request.step, self.timeout
                )
            return UNCHECKED if late else PENDING
        if answer.digest == NONDETERMINISTIC:
            return UNCHECKED
        return PASSED if answer.digest == out.request.digest else MISMATCH
