"""An ``Assignment`` read from a published decision, decoded only when a rank list is used.

Why: every rank reads the restart decision (``policy.Decision.from_json``), whose assignment is
run-length encoded (``ranks.encode_ranks``: a few bytes however large the job). Expanding the
runs into tuples of every rank costs each rank O(ranks) when it is released: at 4,096 simulated
ranks sharing one machine (benchmarks/restart_scale.py) that was the largest part of a rank's
CPU at the barrier (docs/scale.md). Released, a rank needs its own place (``rank_of``) and the
world size, which the runs answer in O(runs); the tuples are built on first use of ``active``,
``reserve`` or ``retired`` (the next iteration's set-up), once per object.

Pure: no I/O, no torch. Called from ``policy.Decision.from_json`` (any thread; a first use from
two threads at once decodes twice, to equal values).
"""

from __future__ import annotations

from typing import Any

from restartable.inprocess.protocol.ranks import Assignment, decode_ranks, parse_runs

_LISTS = ("active", "reserve", "retired")


class EncodedAssignment(Assignment):
    """An ``Assignment`` equal to ``Assignment(decode_ranks(active), decode_ranks(reserve),
    frozenset(decode_ranks(retired)))``, built from those three run strings without expanding
    them: ``rank_of`` and ``world_size`` read the runs; ``active``, ``reserve`` and ``retired``
    are decoded on first access. Equality, hashing, ``repr`` and pickling are the plain
    ``Assignment``'s (they read the fields, which decodes them)."""

    def __init__(self, active: str, reserve: str, retired: str) -> None:
        # Frozen dataclass: its own __setattr__ refuses; the fields are filled on first access.
        object.__setattr__(self, "_encoded", (active, reserve, retired))
        object.__setattr__(self, "_active_runs", parse_runs(active))
        parse_runs(reserve), parse_runs(retired)  # refuse a malformed list now, as before

    def __getattr__(self, name: str) -> Any:
        """A field not decoded yet (only those three reach here: the others exist)."""
        encoded = self.__dict__.get("_encoded")
        if encoded is None or name not in _LISTS:
            raise AttributeError(name)
        value: Any = decode_ranks(encoded[_LISTS.index(name)])
        if name == "retired":
            value = frozenset(value)
        object.__setattr__(self, name, value)
        return value

    def rank_of(self, initial_rank: int) -> int | None:
        if "active" in self.__dict__:
            return super().rank_of(initial_rank)
        offset = 0
        for lo, hi in self._active_runs:
            if lo <= initial_rank <= hi:
                return offset + initial_rank - lo
            offset += hi - lo + 1
        return None

    @property
    def world_size(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self._active_runs)

    def __eq__(self, other: object) -> bool:
        # The dataclass's __eq__ compares only objects of the very same class: an
        # EncodedAssignment equals the plain Assignment of the same lists.
        if not isinstance(other, Assignment):
            return NotImplemented
        return (self.active, self.reserve, self.retired) == (
            other.active,
            other.reserve,
            other.retired,
        )

    def __hash__(self) -> int:
        return hash((self.active, self.reserve, self.retired))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Assignment, (self.active, self.reserve, self.retired))
