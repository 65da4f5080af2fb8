"""The key layout of the restart protocol in the coordination store, and its plain values.

Layout (all under ``restartable/``): ``it{n}/`` is restart iteration ``n``'s namespace, so no key
of an earlier iteration is ever read again. Inside it:

* ``faults``        appended JSON lines, one ``FaultRecord`` each (``fault_records``)
* ``end``           first writer wins: ``"fault"`` (any fault) or ``"done"`` (all active ranks
                    returned); every monitor and every waiting rank blocks on this one key
                    (``iteration_end``)
* ``join/*``        the barrier active ranks pass before creating the process group
* ``ready/*``       the barrier they pass after it, before ``train()``; a fault breaks both
                    (``barriers``)
* ``done/*``        the completion counter (``n``) and every completed rank's token
                    (``ranks``): the evidence behind "done"
* ``restart/*``     the barrier after a fault (live ranks and death reports count once each:
                    ``counted/<rank>``, ``n``); ``full`` names who completed the count, who
                    takes the decision (``decider``: the claim when a death report
                    completed it); ``go`` is the decision (JSON), first writer wins, so
                    every rank reads the same one; every waiter blocks on ``go`` alone
                    (``restart_meeting``)
* ``pg/``           the prefix handed to ``init_process_group`` and to ``ctx.store``
* ``reserves``      the iteration's warm reserves (``inprocess.restart.demotion`` checks one is
                    free), as ranges (``ranks.encode_ranks``)

Job-wide: ``gone`` (appended initial ranks whose process is gone, any iteration).

Cost at scale (docs/scale.md, ``benchmarks/restart_scale.py``): every rank makes a constant
number of calls per restart and reads no value that lists every rank, except the decision, whose
assignment is run-length encoded; exactly one rank takes the decision; every wait is a blocking
``wait`` on one key (re-checked every ``barriers.RECHECK_S`` for the rare races), never a poll.

This module names keys and reads or writes plain values; it never blocks. The protocol's steps
live above it: ``fault_records``, ``iteration_end``, ``barriers``, ``restart_meeting``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from restartable.inprocess.protocol.ranks import decode_ranks, encode_ranks
from restartable.inprocess.protocol.store import Store

ROOT = "restartable/"
GONE_KEY = ROOT + "gone"
# ``restart/expected``'s prefix when the iteration's ranks meet by node (``participants_item``).
BY_NODE = "node:"
# The values of an iteration's ``end`` key.
OUTCOME_FAULT = "fault"
OUTCOME_DONE = "done"


def peek(store: Store, key: str) -> bytes | None:
    """The value of ``key``, or None when it is absent; never blocks, never writes (etcd: one
    range request; a TCPStore: ``check``, then ``get``)."""
    return store.try_get(key)


def peek_many(store: Store, keys: Sequence[str]) -> list[bytes | None]:
    """``peek`` of several keys (etcd: one transaction; a TCPStore: one by one). Never blocks,
    never writes."""
    return store.try_get_many(list(keys))


def set_many(store: Store, values: Mapping[str, str]) -> None:
    """Set several keys in one ``multi_set`` (the TCPStore and etcd: one round trip /
    transaction)."""
    store.multi_set(list(values), list(values.values()))


def parse_ranks(raw: bytes | None) -> set[int]:
    """The ranks of a comma-separated list value (``gone``, ``joiners``); empty when absent."""
    return set() if raw is None else {int(x) for x in raw.decode().split(",") if x}


def iteration_prefix(iteration: int) -> str:
    """The key prefix of restart iteration ``iteration`` (for ``PrefixStore`` and tests)."""
    return f"{ROOT}it{iteration}/"


def key(iteration: int, name: str) -> str:
    """The full key of ``name`` (a name of the layout above) in iteration ``iteration``."""
    return iteration_prefix(iteration) + name


def end_key(iteration: int) -> str:
    """The key every waiter of ``iteration`` blocks on (``iteration_end.wait_outcome``)."""
    return key(iteration, "end")


def pg_prefix(iteration: int) -> str:
    """The prefix under which iteration ``iteration``'s process group and ``ctx.store`` live."""
    return key(iteration, "pg")


def describe_keys(iteration: int) -> Sequence[str]:
    """The well-known keys of ``iteration`` (for debugging tools)."""
    return [key(iteration, k) for k in ("faults", "end", "join/go", "restart/go")]


def participants_item(iteration: int, count: int, *, by_node: bool = False) -> tuple[str, str]:
    """The key and value of how many ranks (active + reserve) take part in ``iteration``
    (``restart_meeting.set_participants``; for one ``set_many`` with others). ``by_node``: the
    ranks meet by node (``node_barrier``), marked ``BY_NODE`` + count: nobody counts ranks on
    the job store then, and a death report reads the mark instead of counting
    (``fault_records.count_once``)."""
    return key(iteration, "restart/expected"), f"{BY_NODE if by_node else ''}{count}"


def gone_ranks(store: Store) -> set[int]:
    """Initial ranks whose process is known to be gone (any iteration); never blocks."""
    return parse_ranks(peek(store, GONE_KEY))


def set_reserves(store: Store, iteration: int, reserves: Sequence[int]) -> None:
    """The warm reserves (initial ranks) of ``iteration``; every rank writes the same value."""
    store.set(*reserves_item(iteration, reserves))


def reserves_item(iteration: int, reserves: Sequence[int]) -> tuple[str, str]:
    """The key and value ``set_reserves`` writes. Run-length encoded (``ranks.encode_ranks``):
    reserves are mostly consecutive ranks, so the value stays a few bytes however many ranks
    the job has, and every rank writes it."""
    return key(iteration, "reserves"), encode_ranks(reserves)


def reserves(store: Store, iteration: int) -> tuple[int, ...]:
    """The warm reserves of ``iteration`` (``set_reserves``; () when unknown); never blocks."""
    raw = peek(store, key(iteration, "reserves"))
    return () if raw is None else decode_ranks(raw.decode())
