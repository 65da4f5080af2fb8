"""The parts a packed shard moves in (to a peer, from a file): their bounds, and where a
reader places each."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from restartable.checkpoint.local.packing import Parsed

PART_MAX = 32 << 20  # a shard moves in parts of at most this size (see part_bounds)
DIRECT_MIN = 1 << 20  # a tensor this large is a part (or parts) of its own

# place(buf, bounds): called once part 0 (the header) of a shard is in buf[:bounds[1]]; returns
# {part index (>= 1): a uint8 tensor of exactly that part's size} for the parts that should land
# somewhere else than buf (a peer's or a file's copy restored straight into the state). Those
# parts are checksummed where they land.
Place = Callable[[torch.Tensor, list[int]], dict[int, torch.Tensor]]


def part_bounds(nbytes: int, parsed: Parsed | None) -> list[int]:
    """Boundaries 0 = b[0] < b[1] < ... < b[n] = nbytes of the parts a shard moves in (to a peer,
    from a file), so that a reader checksums one part while the next arrives and can take each
    large tensor straight into its place: the header alone first, then every tensor of at least
    DIRECT_MIN bytes in parts of its own, the bytes between them in parts of at most PART_MAX.
    Without the header (parsed None): parts of at most PART_MAX."""
    cuts = [0]
    if parsed is not None and parsed.data_start <= nbytes:
        cuts.append(parsed.data_start)
        for e in sorted(parsed.entries.values(), key=lambda e: e.offset):
            base = parsed.data_start + e.offset
            # Entries outside the shard or overlapping can only come from a corrupt header: they
            # travel with the bytes around them, and the reader's checksum rejects the copy.
            if e.nbytes >= DIRECT_MIN and base >= cuts[-1] and base + e.nbytes <= nbytes:
                cuts += [base, base + e.nbytes]
    cuts.append(nbytes)
    out = [0]
    for a, b in itertools.pairwise(cuts):
        out += range(a + PART_MAX, b, PART_MAX)
        if b > out[-1]:
            out.append(b)
    return out
