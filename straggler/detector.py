"""``Detector``: time sections, report per-rank scores every ``report_time_interval``, and act
(stop, or hand a confirmed straggler to the restart loop for a warm reserve to replace it)."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.straggler import scores
from restartable.straggler.config import DetectorConfig
from restartable.straggler.decide import decide, rank_numbers
from restartable.straggler.errors import ConfigError
from restartable.straggler.gather import StoreRounds
from restartable.straggler.report import Report
from restartable.straggler.schedule import Plan, first_plan, next_plan
from restartable.straggler.timing import Section, cuda_timing

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)
# The run journal's channel (see inprocess/journal.py; a name: straggler does not import it).
_journal = logging.getLogger("restartable.journal")


class Detector:
    """Per-rank performance scores of the sections this rank times, reported by every rank.

    Construct one per ``train()`` call on every rank (under ``@restartable``: inside ``train()``,
    with ``context=ctx``; without it: with the job's ``store``, ``rank`` and ``world_size``).
    Then, in the training thread::

        with det.section("step"):          # any sections; the same names on every rank
            ...
        det.report_if_due(step)            # every rank, at every step, same step numbers
        if det.should_stop: ...            # stop_if_detected: checkpoint and exit

    ``report_if_due`` costs one comparison on most steps; at a round it talks to the store
    (a sync: one compare-and-set; a report: one write, a wait of at most ``gather_timeout``
    for the others' numbers, one compare-and-set). Options: ``DetectorConfig``'s fields, as
    ``Detector(config)`` or as keywords. ``on_report(report)`` runs on every rank after each
    report (e.g. to write it to the run's journal). ``clock`` (``inprocess.clock.Clock``: its
    ``monotonic`` times the schedule) and ``cpu_clock`` (what a CPU section measures: process
    CPU time; ``time.thread_time`` for the calling thread's only) are for tests and special
    cases.
    """

    def __init__(
        self,
        config: DetectorConfig | None = None,
        /,
        *,
        context: Any = None,
        store: dist.Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        host: str | None = None,
        on_report: Callable[[Report], None] | None = None,
        clock: Clock = SYSTEM,
        cpu_clock: Callable[[], float] = time.process_time,
        **options: Any,
    ) -> None:
        config = _config_from(config, options)
        self.config = config
        # The restart context's replace_rank(rank, reason=, tag=) (duck-typed: no inprocess import).
        self._demote: Callable[..., bool] | None = None
        if context is not None:
            _check_context_alone(store, rank, world_size)
            store, rank, world_size = context.store, context.rank, context.world_size
            self._demote = getattr(context, "replace_rank", None)
        rank = 0 if rank is None else rank
        world_size = 1 if world_size is None else world_size
        _check_membership(config, store, rank, world_size, can_demote=self._demote is not None)
        self.rank, self.world_size = rank, world_size
        self.host = host or socket.gethostname()
        self.on_report = on_report
        self.clock = clock
        self.cpu_clock = cpu_clock
        self._rounds: StoreRounds | None = None  # None: a single rank without a store
        if store is not None:
            self._rounds = StoreRounds(
                store, rank=rank, world_size=world_size, timeout=config.gather_timeout, clock=clock
            )
        self._cuda = cuda_timing(config.timer)
        self._sections: dict[str, Section] = {}
        self._history: deque[dict[str, float]] = deque(maxlen=config.individual_window)
        self._streaks: dict[int, int] = {}
        self._plan: Plan | None = None
        self._round = 0
        self._round_at = (0, 0.0)  # (step, clock) of the last round
        self._report_at = 0.0  # clock of the last report (or of the first call)
        self.should_stop = False
        self.last_report: Report | None = None

    # ----- timing ----------------------------------------------------------------------------

    def section(self, name: str) -> Section:
        """A context manager timing one entry of section ``name`` (reusable, not reentrant).

        Entering a section while it is open raises ``SectionError``; other sections may nest.
        """
        sec = self._sections.get(name)
        if sec is None:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"section name ({name!r}) must be a non-empty string")
            sec = self._sections[name] = Section(
                name, every=self.config.profiling_interval, cuda=self._cuda, clock=self.cpu_clock
            )
        return sec

    # ----- rounds ----------------------------------------------------------------------------

    def report_if_due(self, step: int) -> Report | None:
        """Run the round planned for ``step`` if this is it; the report when one was made.

        Call on every rank after each step with the same step numbers (any rank that skips a
        round makes the others wait ``gather_timeout`` and is listed as missing). Returns the
        report on every rank (the same one), else None. May block up to ``gather_timeout``.
        """
        plan = self._plan
        if plan is not None and step < plan.step:
            return None
        now = self.clock.monotonic()
        if plan is None:
            self._plan = self._sync(0, first_plan(step))
            self._round_at, self._report_at = (step, now), now
            return None
        self._round += 1
        last_step, last_t = self._round_at
        per_step = (now - last_t) / max(1, step - last_step)
        self._round_at = (step, now)
        if not plan.report:
            self._plan = self._sync(
                self._round,
                next_plan(
                    step=step,
                    gap=plan.gap,
                    seconds_per_step=per_step,
                    since_report=now - self._report_at,
                    interval=self.config.report_time_interval,
                ),
            )
            return None
        proposal = next_plan(
            step=step,
            gap=plan.gap,
            seconds_per_step=per_step,
            since_report=0.0,
            interval=self.config.report_time_interval,
        )
        report = self._report(step, proposal, started=now)
        self._report_at = now
        return report

    def _sync(self, k: int, proposal: Plan) -> Plan:
        if self._rounds is None:
            return proposal
        return Plan.from_json(self._rounds.sync(k, proposal.to_json()))

    def _report(self, step: int, proposal: Plan, *, started: float) -> Report:
        cfg = self.config
        times = scores.section_times({n: s.drain() for n, s in self._sections.items()})
        individual: float = 1.0
        ind_sections: dict[str, float] = {}
        if cfg.calc_individual_gpu_perf:
            individual, ind_sections = scores.individual_score(times, list(self._history))
        if times:
            self._history.append(times)
        mine = rank_numbers(self.host, times, individual, ind_sections)

        def publish(present: dict[int, str], missing: tuple[int, ...]) -> str:
            """The report and the next plan, decided by whichever rank publishes first."""
            report = decide(
                cfg,
                present,
                missing,
                round=self._round,
                step=step,
                streaks=self._streaks,
                started=started,
                clock=self.clock,
            )
            return json.dumps({"report": report.to_json(), "plan": proposal.to_json()})

        if self._rounds is None:
            answer = publish({self.rank: mine}, ())
        else:
            answer = self._rounds.report(self._round, mine, publish)
        published = json.loads(answer)
        self._plan = Plan.from_json(published["plan"])
        report = Report.from_json(published["report"])
        self._act(report)
        return report

    def _act(self, report: Report) -> None:
        """Log the published report, then stop or demote as it says (every rank the same)."""
        self._streaks = dict(report.streaks)
        self.last_report = report
        log.info("rank %d: %s", self.rank, report.format(self.config.num_gpu_perf_scores_to_print))
        if _journal.handlers:  # the run journal (inprocess/journal.py), when one is open
            _journal.debug("straggler_report", extra={"journal": dataclasses.asdict(report)})
        if self.on_report is not None:
            self.on_report(report)
        if report.stop:
            self.should_stop = True
        if report.demote is None or self._demote is None:
            return
        rank = report.demote
        why = ", ".join(report.stragglers.get(rank, ()))
        reason = (
            f"straggler in {report.streaks.get(rank, 0)} consecutive reports ({why}) "
            f"at step {report.step}"
        )
        if self.rank == rank:
            log.warning("rank %d: %s: asking for a warm reserve", self.rank, reason)
        # Every rank calls it (the same report): under @restartable it normally does not
        # return, the restart interrupts it; without a free reserve every rank gets False.
        if not self._demote(rank, reason=reason, tag=f"straggler-{report.round}"):
            log.info("rank %d: no warm reserve to replace rank %d: reported only", self.rank, rank)


def _config_from(config: DetectorConfig | None, options: dict[str, Any]) -> DetectorConfig:
    """``Detector``'s config: the one given, or one built from its keyword options."""
    if config is not None and options:
        raise ConfigError(
            f"Detector got a config and keyword options {sorted(options)}: pass one of them"
        )
    if config is not None:
        return config
    try:
        return DetectorConfig(**options)
    except TypeError as exc:
        raise ConfigError(f"Detector: {exc}: the options are DetectorConfig's") from None


def _check_context_alone(*members: object) -> None:
    """``context=`` reads the store, the rank and the world size: none may be given beside it."""
    if any(m is not None for m in members):
        raise ConfigError(
            "Detector got context= and store/rank/world_size: pass one of them "
            "(context= reads all three from the restart context)"
        )


def _check_membership(
    config: DetectorConfig,
    store: dist.Store | None,
    rank: int,
    world_size: int,
    *,
    can_demote: bool,
) -> None:
    """Reject a rank outside the world or a multi-rank detector without a store; warn when
    ``replace_if_detected`` cannot act."""
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank ({rank}) must be in 0..world_size-1 ({world_size - 1})")
    if store is None and world_size > 1:
        raise ConfigError(
            f"Detector needs a store for world_size {world_size}: pass context=ctx under "
            "@restartable, or store= (e.g. the TCPStore of the job) with rank= and "
            "world_size="
        )
    if config.replace_if_detected and not can_demote:
        log.warning(
            "replace_if_detected is ignored: replacing a straggler needs @restartable "
            "(Detector(context=ctx)); stragglers are reported%s only",
            " and stopped" if config.stop_if_detected else "",
        )
