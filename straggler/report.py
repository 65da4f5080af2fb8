"""``Report``: one straggler report as every rank receives it, its JSON form and its log text."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


def _int_keys(d: dict[str, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in d.items()}


@dataclass(frozen=True)
class Report:
    """The scores of one report round, published once; every rank acts on the same one.

    ``relative``/``individual``: {rank: score} (empty when that family is off);
    ``section_relative``/``section_individual``: {section: {rank: score}}. ``stragglers``:
    {rank: reasons}. ``streaks``: consecutive reports each flagged rank has been flagged in.
    ``demote``: the rank to replace by a warm reserve after this report (None: none);
    ``deferred``: confirmed stragglers left for a later report (one demotion per report).
    ``stop``: every rank should stop (``stop_if_detected`` and a straggler). ``missing``: ranks
    whose numbers did not arrive within ``gather_timeout``. ``job_trend``: the job's own
    individual score (the upper median of the ranks'), which ``individual`` is relative to: below
    1.0 the whole job runs slower than in its recent past. ``elapsed``: seconds the publishing
    rank spent on the round. ``step``/``round``: where it happened.
    """

    round: int
    step: int
    hosts: dict[int, str]
    relative: dict[int, float]
    individual: dict[int, float]
    section_relative: dict[str, dict[int, float]] = field(default_factory=dict)
    section_individual: dict[str, dict[int, float]] = field(default_factory=dict)
    stragglers: dict[int, tuple[str, ...]] = field(default_factory=dict)
    streaks: dict[int, int] = field(default_factory=dict)
    demote: int | None = None
    deferred: tuple[int, ...] = ()
    stop: bool = False
    missing: tuple[int, ...] = ()
    job_trend: float = 1.0
    elapsed: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Report:
        d = json.loads(text)
        return cls(
            round=d["round"],
            step=d["step"],
            hosts=_int_keys(d["hosts"]),
            relative=_int_keys(d["relative"]),
            individual=_int_keys(d["individual"]),
            section_relative={s: _int_keys(v) for s, v in d["section_relative"].items()},
            section_individual={s: _int_keys(v) for s, v in d["section_individual"].items()},
            stragglers={int(r): tuple(why) for r, why in d["stragglers"].items()},
            streaks=_int_keys(d["streaks"]),
            demote=d["demote"],
            deferred=tuple(d["deferred"]),
            stop=d["stop"],
            missing=tuple(d["missing"]),
            job_trend=d["job_trend"],
            elapsed=d["elapsed"],
        )

    def format(self, top: int) -> str:
        """The report as one multi-line text (one log record): the ``top`` worst and best ranks
        of each score family with their hosts, then the stragglers and what is done about them.
        """
        n = len(self.hosts)
        lines = [f"straggler report {self.round} at step {self.step} ({n} ranks):"]
        for title, scores in (
            ("relative performance", self.relative),
            ("individual performance", self.individual),
        ):
            if not scores or top == 0:
                continue
            ordered = sorted(scores.items(), key=lambda kv: (kv[1], kv[0]))
            k = min(top, len(ordered))
            lines.append(f" {title}: worst {k}/{len(ordered)} ranks:")
            lines += [self._line(r, s) for r, s in ordered[:k]]
            lines.append(f" {title}: best {k}/{len(ordered)} ranks:")
            lines += [self._line(r, s) for r, s in reversed(ordered[-k:])]
        if self.job_trend < 1.0:
            lines.append(
                f" job speed against its recent past: {self.job_trend:.2f} (every rank alike: "
                "individual scores above are relative to it)"
            )
        if self.stragglers:
            found = "; ".join(
                f"rank {r} ({self.hosts.get(r, '?')}: {', '.join(why)}, "
                f"{self.streaks.get(r, 1)} report(s) in a row)"
                for r, why in self.stragglers.items()
            )
            lines.append(f" stragglers: {found}")
        else:
            lines.append(" stragglers: none")
        if self.demote is not None:
            lines.append(f" action: rank {self.demote} to be replaced by a warm reserve")
        if self.deferred:
            lines.append(
                f" deferred: rank(s) {list(self.deferred)} confirmed too, left for the next "
                "report (one demotion per report: each costs a restart and a reserve)"
            )
        if self.stop:
            lines.append(" action: stop requested (stop_if_detected)")
        if self.missing:
            lines.append(
                f" missing: rank(s) {list(self.missing)} sent no numbers in time (dead, or not "
                "calling report_if_due at the same steps as the others)"
            )
        lines.append(f" straggler report processing time: {self.elapsed:.3f} s")
        return "\n".join(lines)

    def _line(self, rank: int, score: float) -> str:
        return f"  rank={rank} host={self.hosts.get(rank, '?')} score={score:.2f}"
