"""Fault injection for tests, examples and drills: make a chosen rank fail in a chosen way, once,
and record every fault that fired (so a test can count them and a report can time them).

    from restartable.inprocess import faults
    faults.inject("exception", rank=1, step=5, current_step=step, record_dir=tmp)  # in train()
    nan = faults.fire_planned(plan, step=step, record_dir=run_dir)      # plan: parse_plan(...)
    faults.fired(tmp)                                                   # -> [FiredFault, ...]
"""

from restartable.inprocess.faults.firing import burn, fire, fire_planned, inject, slowdown, trigger
from restartable.inprocess.faults.kinds import (
    ALIASES,
    HANG_S,
    KINDS,
    SLOW_FACTOR,
    InjectedFault,
    Kind,
    kind_of,
    kinds_help,
)
from restartable.inprocess.faults.plan import (
    ITEM_SYNTAX,
    SYNTAX,
    PlannedFault,
    demo_plan,
    no_rank_left,
    parse_plan,
    plan_help,
    shrink_warning,
)
from restartable.inprocess.faults.record import FiredFault, fired

__all__ = [
    "ALIASES",
    "HANG_S",
    "ITEM_SYNTAX",
    "KINDS",
    "SLOW_FACTOR",
    "SYNTAX",
    "FiredFault",
    "InjectedFault",
    "Kind",
    "PlannedFault",
    "burn",
    "demo_plan",
    "fire",
    "fire_planned",
    "fired",
    "inject",
    "kind_of",
    "kinds_help",
    "no_rank_left",
    "parse_plan",
    "plan_help",
    "shrink_warning",
    "slowdown",
    "trigger",
]
