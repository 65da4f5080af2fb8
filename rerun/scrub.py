"""``Scrubber``: silent data corruption caught by re-computing sampled steps (docs/rerun.md).

    scrub = Scrubber(every=5, mode="reserve", compute=fwd, make_model=build, make_store=client)
    @restartable(prewarm=scrub.serve, ...)        # a warm reserve re-computes while it waits
    def train():
        scrub.begin(model, rank=ctx.rank, world=ctx.world_size, initial_rank=ctx.initial_rank)
        start = scrub.restore(mgr.load_latest(ckpt) or 0, restore=state.load_state_dict)
        for step in range(start, steps):
            scrub.before_step(step, batch, snapshot=state.state_dict)   # copies, sampled steps
            loss = fwd(net, batch); loss.backward()
            scrub.after_step(loss)                     # the verdict: may raise (a finding)
            opt.step()
    try:
        train()
    finally:
        scrub.close()   # stops and joins its threads before the interpreter exits

``mode="reserve"``: every ``every`` steps one active rank (rotating: each rank every
``every * world`` steps) sends its step to a reserve, which re-computes it; a mismatch is
settled by the rank re-computing it once more (``rerun.scrub_judge``). ``"in_place"``: each
rank re-computes its own sampled step (transient faults only, ``rerun.scrub_inplace``).
A finding raises ``SilentDataCorruption`` (retiring a persistently faulty rank) and the job
rolls back to the newest verified step (``rerun.scrub_rollback``).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from restartable.rerun import agree, scrub_inplace
from restartable.rerun.scrub_finding import (
    Quarantines,
    SdcFinding,
    SilentDataCorruption,
    quarantine,
    report_finding,
)
from restartable.rerun.scrub_judge import Judge, Mismatch
from restartable.rerun.scrub_reserve import ReserveChecker
from restartable.rerun.scrub_rollback import Snapshots, rollback
from restartable.rerun.scrub_wire import Request, ScrubStore
from restartable.rerun.sdc_digest import Captured, Compute, params_of, recompute

logger = logging.getLogger(__name__)

Mode = Literal["off", "in_place", "reserve"]
MODES = ("off", "in_place", "reserve")
CLOSE_TIMEOUT_S = 10.0  # close(): a check in progress on a reserve at idle priority ends first
_VERDICTS = {1: "transient", 2: "persistent", 3: "nondeterministic"}


class Scrubber:
    """Create once per process, outside ``@restartable``'s ``train()`` (it keeps the verified
    copies and a pending rollback across restarts)."""

    def __init__(
        self,
        *,
        every: int,
        mode: Mode,
        compute: Compute,
        make_model: Callable[[], torch.nn.Module] | None = None,
        make_store: Callable[[], ScrubStore] | None = None,
        verdict_timeout: float = 30.0,
        checkpoints: Quarantines | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode ({mode!r}) must be one of {MODES}: pick one")
        if every < 1:
            raise ValueError(f"every ({every}) must be >= 1: check every K-th step, K >= 1")
        if mode == "reserve" and (make_model is None or make_store is None):
            raise ValueError("mode 'reserve' needs make_model and make_store: pass both")
        self.every, self.mode, self._compute = every, mode, compute
        self._make_model, self._make_store = make_model, make_store
        self._timeout = verdict_timeout
        self._checkpoints = checkpoints  # a finding quarantines its later checkpoints
        self.snaps = Snapshots()
        self._checker: ReserveChecker | None = None
        self._judge: Judge | None = None
        self._module: torch.nn.Module | None = None
        self._rank = self._world = self._initial = 0
        self._verified = False  # in place: determinism verified at the first check
        self._open: tuple[Any, torch.Tensor, Captured, Any] | None = None
        self._judging = False  # a sampled step's all-reduce started (reserve mode)
        self._step = 0
        self.findings: list[SdcFinding] = []

    # -- reserve side ----------------------------------------------------------------------------

    def serve(self) -> None:
        """Start re-computing the active ranks' steps on this (reserve) process; returns at
        once. No-op unless ``mode == "reserve"``."""
        if self.mode != "reserve" or self._checker is not None:
            return
        assert self._make_model is not None and self._make_store is not None
        self._checker = ReserveChecker(
            make_store=self._make_store,
            make_model=self._make_model,
            compute=self._compute,
            name=f"{socket.gethostname()}:{_initial_rank()}",
        )
        self._checker.start()

    @property
    def reserve_stats(self) -> tuple[int, float]:
        """(checks answered, seconds spent) by this process as a reserve."""
        c = self._checker
        return (c.checks, c.seconds) if c is not None else (0, 0.0)

    # -- active side -----------------------------------------------------------------------------

    def begin(self, module: torch.nn.Module, *, rank: int, world: int, initial_rank: int) -> None:
        """At the start of each ``train()`` call: this process trains ``module`` (the plain
        module: the one under a DDP wrapper) as ``rank`` of ``world``."""
        if self._checker is not None:
            self._checker.stop()
        self._module, self._rank, self._world, self._initial = module, rank, world, initial_rank
        self._open, self._judging = None, False
        if self.mode == "reserve":
            assert self._make_store is not None
            old = self._judge
            self._judge = Judge(self._make_store, rank=rank, world=world, timeout=self._timeout)
            self._judge.resume(old, self.snaps)

    def wait_for_reserve(self, timeout: float) -> bool:
        """COLLECTIVE (reserve mode): wait up to ``timeout`` seconds until a reserve serves
        checks, so that the first steps are checked too (a reserve starts serving once its
        imports are done). Returns whether one does; without one, training goes on unchecked."""
        if self.mode != "reserve" or self._judge is None:
            return False
        return self._judge.wait_ready(timeout)

    def restore(self, loaded: int, *, restore: Callable[[Any], None]) -> int:
        """COLLECTIVE, after the checkpoint load of each ``train()`` call: the step to start
        from (``loaded``, or the verified step a finding rolls back to)."""
        if self.mode == "off":
            return loaded
        return rollback(self.snaps, loaded, restore)

    def before_step(self, step: int, batch: Any, *, snapshot: Callable[[], Any]) -> None:
        """Before the step's forward pass (every rank, every step). On sampled steps: start
        agreeing on the answers that came in (reserve mode: ``after_step`` reads the verdict),
        and prepare this step's check: copy the state (``snapshot``), the RNG state, capture
        the gradients."""
        self._step = step
        if self.mode == "off" or step % self.every != 0 or self._module is None:
            return
        rng = torch.get_rng_state()
        if self.mode == "in_place":
            self._open_capture(batch, rng, None)
            return
        assert self._judge is not None
        self._judge.launch(step, self.every)
        self._judging = True
        if self._judge.may_send():
            checked = self._judge.checked_rank(step, self.every)
            # The rollback copy: kept by the next rank, which a retirement of the checked one
            # leaves in the job (each rank copies its state once per rotation, not per check).
            # Taken now, before the step changes the state; dropped if the step is not sent.
            if (checked + 1) % self._world == self._rank:
                self.snaps.take(step, snapshot)
            if checked == self._rank:
                self._open_capture(batch, rng, params_of(self._module))

    def after_step(self, loss: torch.Tensor) -> None:
        """After the backward pass, before the optimizer step (every rank, every step). On
        sampled steps in reserve mode: the verdict on the answers that came in (may raise
        ``SilentDataCorruption``), then this step's check sent to the reserve."""
        opened, self._open = self._open, None
        if opened is not None:
            opened[2].close()
        if self.mode == "reserve" and self._judging:
            self._judging = False
            self._judge_and_send(loss, opened)
        elif opened is not None and self.mode == "in_place":
            self._check_in_place(opened[0], opened[1], opened[2], loss)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Once, as the process ends (after its last ``train()`` call, also a failed one):
        stop this process's scrubbing threads and wait for them, up to ``timeout`` s in all.
        Why wait: a (daemon) thread still inside a torch or store call when the interpreter
        finalises is ended from C++ as it returns, which aborts the process ("terminate
        called without an active exception", exit status -6)."""
        _stop_threads(self._judge, self._checker, timeout)

    # -- internals -------------------------------------------------------------------------------

    def _judge_and_send(self, loss: torch.Tensor, opened: Any) -> None:
        """COLLECTIVE, sampled steps in reserve mode: settle what the all-reduce started by
        ``before_step`` found, then send this step if it is this rank's turn."""
        assert self._judge is not None
        for mismatch in self._judge.collect():
            self._settle_mismatch(mismatch)
        step = self._step
        sends = self._judge.sends_now(step, self.every)
        checked = self._judge.checked_rank(step, self.every)
        if (checked + 1) % self._world == self._rank:
            if not sends:
                self.snaps.drop(step)
            self.snaps.keep_from(self._judge.oldest_needed())
        if sends and checked == self._rank and opened is not None:
            batch, rng, captured, params = opened
            req = Request(step, self._rank, params, batch, rng)
            self._judge.submit(req, captured.grads, loss)

    def _open_capture(self, batch: Any, rng: torch.Tensor, params: Any) -> None:
        assert self._module is not None
        self._open = (batch, rng, Captured(self._module), params)

    def _check_in_place(self, batch: Any, rng: torch.Tensor, cap: Captured, loss: Any) -> None:
        assert self._module is not None
        first = scrub_inplace.first_digest(cap.grads, loss)
        code, digests = scrub_inplace.check_own_step(
            self._module,
            self._compute,
            batch=batch,
            rng=rng,
            first=first,
            verify=not self._verified,
        )
        codes = scrub_inplace.agree_codes(code, rank=self._rank, world=self._world)
        self._verified = True
        if scrub_inplace.NONDETERMINISTIC in codes:
            logger.error(
                "sdc scrubbing: step %d is not bitwise deterministic on rank(s) %s: scrubbing "
                "is off for this run (make the step deterministic to scrub)",
                self._step,
                [r for r, c in enumerate(codes) if c == scrub_inplace.NONDETERMINISTIC],
            )
            self.mode = "off"
            return
        if scrub_inplace.ROLLBACK in codes:
            suspect = codes.index(scrub_inplace.ROLLBACK)
            finding = self._finding(suspect, self._step, "transient", "3 computations in place")
            self._raise(finding, digests, retire=False)

    def _settle_mismatch(self, m: Mismatch) -> None:
        """COLLECTIVE: the third computation (the suspect re-runs its step from the request,
        on its own device), its verdict agreed, then report and raise on every rank."""
        assert self._judge is not None and self._module is not None
        code, checker = 0, "a reserve"
        if m.mine is not None:
            req, answer = m.mine.request, m.mine.answer
            assert answer is not None
            third = recompute(self._module, self._compute, req.batch, req.rng, req.params)
            code = 2 if third == req.digest else 1 if third == answer.digest else 3
            checker = f"reserve {answer.checker}"
        verdict = _VERDICTS[
            scrub_inplace.agree_codes(code, rank=self._rank, world=self._world)[m.rank]
        ]
        target = m.step if verdict == "transient" else self._judge.rollback_target(m.rank)
        how = {"transient": "gave the reserve's", "persistent": "gave its own again"}.get(
            verdict, "gave a third"
        )
        settled_by = f"rank {m.rank}'s re-run {how} result ({checker} disagreed with its first)"
        finding = self._finding(m.rank, m.step, verdict, settled_by, target=target)
        if verdict == "nondeterministic":
            logger.error("%s: scrubbing is off for this run", finding.line())
            self.mode = "off"
            return
        self._judge.after_finding(m.rank, persistent=verdict == "persistent", target=target)
        self._raise(finding, (), retire=verdict == "persistent")

    def _finding(
        self, suspect: int, step: int, verdict: Any, settled_by: str, *, target: int | None = None
    ) -> SdcFinding:
        checker = "in_place" if self.mode == "in_place" else "reserve"
        return SdcFinding(
            rank=suspect,
            initial_rank=self._initial if suspect == self._rank else -1,
            host=socket.gethostname(),
            step=step,
            verdict=verdict,
            settled_by=settled_by,
            detected_at=self._step,
            rollback_to=step if target is None else target,
            checker=checker,
        )

    def _raise(self, finding: SdcFinding, digests: tuple[str, ...], *, retire: bool) -> None:
        """COLLECTIVE. Every rank records the rollback, then the suspect raises (its restart
        tears the group down); the other ranks first wait for that, so that the restart blames
        the suspect alone."""
        self.snaps.pending = finding.rollback_to
        self.snaps.forget_after(finding.rollback_to)  # copies of untrusted (or abandoned) states
        self.findings.append(finding)
        quarantine(self._checkpoints, finding)
        # The suspect raises only once every rank holds the rollback target: the restart it
        # starts interrupts the others, and a retired suspect takes its own record with it
        # (a rank interrupted before it had recorded the target resumed at the corrupt step).
        agree.reduce_max_(torch.zeros(1, dtype=torch.int64, device=agree.comm_device()))
        if finding.rank == self._rank:
            report_finding(finding)
            raise SilentDataCorruption(finding, retire=retire)
        agree.wait_for_teardown()
        raise SilentDataCorruption(finding, retire=False)


def _stop_threads(judge: Judge | None, checker: ReserveChecker | None, timeout: float) -> None:
    """``Scrubber.close``: stop both, then join both within ``timeout`` s in all."""
    end = time.monotonic() + timeout
    if judge is not None:
        judge.close()
    if checker is not None:
        checker.stop()
    ended = judge is None or judge.join(timeout)
    if checker is not None:
        ended = checker.join(max(0.0, end - time.monotonic())) and ended
    if not ended:
        logger.warning(
            "sdc scrubbing: a scrubbing thread did not stop within %.0f s; the process may "
            "abort as it exits (std::terminate)",
            timeout,
        )


def _initial_rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))
