"""Part boundaries of a shard read from a peer or a file: large tensors can land in place."""

from __future__ import annotations

import itertools

from restartable.checkpoint.local.packing import Parsed, TensorEntry
from restartable.checkpoint.local.parts import DIRECT_MIN, PART_MAX, part_bounds

MiB = 1 << 20


def _parsed(data_start: int, entries: list[tuple[str, int, int]]) -> Parsed:
    table = {k: TensorEntry(k, "uint8", (n,), off, n) for k, off, n in entries}
    return Parsed(table, {}, {}, data_start)


def _valid(cuts: list[int], nbytes: int) -> bool:
    return (
        cuts[0] == 0
        and cuts[-1] == nbytes
        and all(0 < b - a <= PART_MAX for a, b in itertools.pairwise(cuts))
    )


def test_without_a_header_the_shard_goes_in_plain_chunks() -> None:
    n = 2 * PART_MAX + 5
    assert part_bounds(n, None) == [0, PART_MAX, 2 * PART_MAX, n]


def test_header_first_then_each_large_tensor_in_parts_of_its_own() -> None:
    small = [(f"s{i}", 4096 * i, 4096) for i in range(4)]  # 16 KiB of small tensors
    large = ("big", 16 * 1024, 2 * PART_MAX + 100)
    tail = ("after", 16 * 1024 + 2 * PART_MAX + 128, 64)
    ds = 512
    p = _parsed(ds, [*small, large, tail])
    n = ds + tail[1] + 64
    cuts = part_bounds(n, p)
    assert _valid(cuts, n)
    assert cuts[1] == ds  # part 0: the header alone, so a receiver can parse it first
    base = ds + large[1]
    assert base in cuts and base + large[2] in cuts  # its own parts, tiling it exactly
    inside = [c for c in cuts if base < c < base + large[2]]
    assert inside == [base + PART_MAX, base + 2 * PART_MAX]
    assert not any(ds < c < base for c in cuts)  # small tensors share one part


def test_entries_a_corrupt_header_could_hold_are_ignored() -> None:
    assert 2 * MiB >= DIRECT_MIN  # every entry below is large enough for parts of its own
    ds, n = 128, 128 + 8 * MiB
    p = _parsed(
        ds,
        [
            ("ok", 0, 2 * MiB),
            ("overlaps_ok", MiB, 2 * MiB),  # starts inside "ok"
            ("past_the_end", 6 * MiB, 4 * MiB),
        ],
    )
    cuts = part_bounds(n, p)
    assert _valid(cuts, n)
    assert cuts == [0, ds, ds + 2 * MiB, n]
