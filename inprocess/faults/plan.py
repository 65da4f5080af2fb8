"""Fault plans: ``KIND@rankR:stepS[,...]``, the ``demo`` preset and ``none``, parsed and checked."""

from __future__ import annotations

import re
from dataclasses import dataclass

from restartable.inprocess.errors import ConfigError
from restartable.inprocess.faults.kinds import KINDS, kind_of, kinds_help

ITEM_SYNTAX = "KIND@rankR:stepS"
SYNTAX = f"{ITEM_SYNTAX}[,{ITEM_SYNTAX}...]"
_ITEM = re.compile(r"^(?P<kind>[a-z_-]+)@rank(?P<rank>\d+):step(?P<step>\d+)$")


@dataclass(frozen=True)
class PlannedFault:
    """Fault ``kind`` on training rank ``rank`` (``ctx.rank``) at ``step`` of ``iteration``.

    None for ``step``/``iteration`` matches any (``inject`` uses that; a plan item always has a
    step and no iteration). ``name`` is the fault's identity: it fires once per record directory.
    """

    kind: str
    rank: int
    step: int | None
    iteration: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", kind_of(self.kind).name)  # aliases -> table names

    @property
    def name(self) -> str:
        iteration = "" if self.iteration is None else f":iteration{self.iteration}"
        step = "" if self.step is None else f":step{self.step}"
        return f"{self.kind}@rank{self.rank}{iteration}{step}"

    @property
    def loses_rank(self) -> bool:
        return KINDS[self.kind].loses_rank


def demo_plan(steps: int) -> str:
    """Each kind the example shows once, spread over the run (needs 2 active ranks + 1 reserve)."""
    at = [max(1, steps * k // 6) for k in range(1, 6)]
    return (
        f"exception@rank1:step{at[0]},kill@rank1:step{at[1]},hang@rank0:step{at[2]},"
        f"nan@rank1:step{at[3]},exception@rank0:step{at[4]}"
    )


def plan_help() -> str:
    """What a plan may say, with the kinds from the table (for ``--help``)."""
    return (
        f"fault plan: {SYNTAX}\n"
        "  e.g. exception@rank1:step30,kill@rank1:step60\n"
        "  R: the training rank (ctx.rank) at step S; each fault fires once\n"
        "  'demo': exception, kill, hang, nan, exception; 'none': no faults\n"
        f"kinds:\n{kinds_help()}"
    )


def parse_plan(text: str, *, steps: int, world_size: int | None = None) -> list[PlannedFault]:
    """Parse a plan for a run of ``steps`` steps on ``world_size`` training ranks (None: unchecked).

    Raises ConfigError (a ValueError) naming the bad item, the rule and the fix.
    """
    if text.strip() in ("", "none"):
        return []
    source = ""
    if text.strip() == "demo":
        text, source = demo_plan(steps), " (of the demo plan)"
    plan: list[PlannedFault] = []
    for item in text.split(","):
        m = _ITEM.match(item.strip())
        if m is None or m["kind"] not in KINDS:
            raise ConfigError(
                f"fault plan item {item!r} is not {ITEM_SYNTAX} with KIND one of "
                f"{sorted(KINDS)}: write e.g. exception@rank1:step30"
            )
        fault = PlannedFault(m["kind"], int(m["rank"]), int(m["step"]))
        if int(m["step"]) >= steps:
            raise ConfigError(
                f"fault plan item {item!r}{source} is at step {m['step']}, but the run has only "
                f"{steps} steps (0..{steps - 1}): choose an earlier step or run more steps"
            )
        if world_size is not None and fault.rank >= world_size:
            raise ConfigError(
                f"fault plan item {item!r}{source} targets rank {fault.rank}, but only "
                f"{world_size} rank(s) train (ranks 0..{world_size - 1}), so it would never "
                f"fire: choose a rank below {world_size} or train on more ranks"
            )
        if fault in plan:
            raise ConfigError(
                f"fault plan item {item!r} appears twice: a fault fires once per run, "
                "remove the repeat"
            )
        plan.append(fault)
    return plan


def shrink_warning(
    plan: list[PlannedFault], *, world_size: int, active: int, max_respawns: int
) -> str | None:
    """One line when ``plan`` loses more ranks than the warm reserves (``world_size - active``)
    replace and no respawn refills the pool: the job then goes on with fewer ranks and
    restores onto the smaller world (the local tier by resharding, else the persistent tier,
    losing the steps since its newest commit). None when every lost rank is replaced."""
    losing = [f.name for f in plan if f.loses_rank]
    reserves = world_size - active
    if len(losing) <= reserves or max_respawns > 0:
        return None
    return (
        f"the fault plan loses {len(losing)} rank(s) ({', '.join(losing)}) with {reserves} warm "
        f"reserve(s) and respawn off: the job will shrink below {active} ranks and restore onto "
        "the smaller world (lower --active, or launch with --max-respawns 1, to keep its size)"
    )


def no_rank_left(
    plan: list[PlannedFault], *, world_size: int, active: int, max_respawns: int
) -> str | None:
    """One line when ``plan`` kills every training rank: each fault that loses its rank takes a
    warm reserve (``world_size - active``) or, with none left and respawn off, shrinks the
    training ranks by one (a fault on a rank the smaller job no longer has never fires). None
    when a rank is always left, or respawn refills the pool."""
    if max_respawns > 0:
        return None
    reserves, training = world_size - active, active
    lost: list[str] = []
    for fault in sorted(plan, key=lambda f: f.step or 0):
        if not fault.loses_rank or fault.rank >= training:
            continue
        lost.append(fault.name)
        if reserves:
            reserves -= 1
        else:
            training -= 1
        if training == 0:
            return (
                f"the fault plan loses {len(lost)} rank(s) ({', '.join(lost)}), every one of "
                f"the {world_size} process(es), and respawn is off: no rank would be left to "
                f"finish; start {world_size + 1} processes (--nproc-per-node) or launch with "
                "--max-respawns 1"
            )
    return None
