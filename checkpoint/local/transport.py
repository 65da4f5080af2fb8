"""Point-to-point transfer of packed shards on the local tier's gloo group.

Per (sender, receiver) pair: a small header, the part boundaries, then the shard in parts
(parts.part_bounds), all posted at once (isend / irecv), so no pair waits for another and no
collective runs per tensor. Measured on gloo loopback: one flat buffer moves at twice the rate of
per-tensor messages, and all_gather of large buffers is 8x slower than send/recv
(research/anchor-checkpoint.md 6.5). A receiver that restores into a state can take the large
tensors straight into the state's own memory (parts.Place).
"""

from __future__ import annotations

import itertools
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from restartable.checkpoint.local.integrity import Checksum
from restartable.checkpoint.local.packing import Parsed
from restartable.checkpoint.local.parts import Place, part_bounds

# [step, owner, world, nbytes, checksum, number of parts]; nbytes = -1 tells the receiver the
# sender has nothing (its copy failed verification): nothing else follows from that sender.
_HEADER_LEN = 6


@dataclass(frozen=True)
class Outgoing:
    """A shard to send: `buf[:nbytes]` goes to `dst`; buf None means "I cannot provide it".

    parsed: the shard's header; None sends it in plain parts (nothing lands directly).
    """

    dst: int
    step: int
    owner: int
    world: int
    nbytes: int
    checksum: int
    buf: torch.Tensor | None
    parsed: Parsed | None = None


@dataclass
class Incoming:
    """A shard received from `src` (buf None when the sender had nothing)."""

    src: int
    step: int = -1
    owner: int = -1
    world: int = -1
    nbytes: int = -1
    checksum: int = 0  # as sent
    buf: torch.Tensor | None = None
    received: int | None = None  # checksum of what arrived: equal to `checksum` when intact


def transfer(
    pg: dist.ProcessGroup,
    sends: Sequence[Outgoing],
    srcs: Sequence[int],
    alloc: Callable[[int], torch.Tensor],
    place: Place | None = None,
) -> list[Incoming]:
    """Send every `sends` entry and receive one shard from every rank in `srcs`.

    Collective over the ranks named on both sides: each receiver must list each sender exactly
    as often as that sender lists it (pairs are matched in order). `alloc(nbytes)` returns a
    uint8 CPU tensor of at least nbytes for each received shard (its pages need not be touched
    yet: each part is faulted in just before its receive is posted). `place`: see parts.Place.
    Blocks until all transfers end or the group's timeout fires (then raises).
    """
    keep: list[torch.Tensor] = []  # tensors of posted sends stay alive until they complete
    works = _post_sends(pg, sends, keep)
    incoming, active = _receive_bounds(pg, srcs)
    # Part 0 (the header) of every shard first: `place` needs it to decide where the rest lands.
    firsts = []
    for inc, b in active:
        inc.buf = alloc(inc.nbytes)
        first = inc.buf[: int(b[1])]
        _fault_in(first)
        firsts.append(dist.irecv(first, group=pg, group_src=inc.src))
    _wait_all(firsts)
    pending = [(inc, *_post_parts(pg, inc, b.tolist(), place)) for inc, b in active]
    for inc, parts, posted in pending:
        received = Checksum()
        for part, work in zip(parts, posted, strict=True):
            _wait(work)
            received.update(part)
        inc.received = received.value
    _wait_all(works)
    return incoming


def _receive_bounds(
    pg: dist.ProcessGroup, srcs: Sequence[int]
) -> tuple[list[Incoming], list[tuple[Incoming, torch.Tensor]]]:
    """Receive every sender's header, then the part boundaries of each sender that has a shard:
    (one Incoming per sender, in order; (Incoming, its boundaries) per sender with a shard)."""
    incoming = [Incoming(src) for src in srcs]
    heads = [torch.empty(_HEADER_LEN, dtype=torch.int64) for _ in srcs]
    _wait_all([dist.irecv(h, group=pg, group_src=src) for h, src in zip(heads, srcs, strict=True)])
    active: list[tuple[Incoming, torch.Tensor]] = []
    for inc, h in zip(incoming, heads, strict=True):
        inc.step, inc.owner, inc.world, inc.nbytes, inc.checksum, nparts = h.tolist()
        if inc.nbytes >= 0:
            active.append((inc, torch.empty(nparts + 1, dtype=torch.int64)))
    _wait_all([dist.irecv(b, group=pg, group_src=inc.src) for inc, b in active])
    return incoming, active


def _post_parts(
    pg: dist.ProcessGroup, inc: Incoming, cuts: list[int], place: Place | None
) -> tuple[list[torch.Tensor], list[dist.Work | None]]:
    """Post the receives of one shard's parts after part 0 (already in ``inc.buf``), each into
    where ``place`` puts it or into ``inc.buf``: (every part, its receive; None for part 0)."""
    assert inc.buf is not None
    dests = place(inc.buf, cuts) if place is not None else {}
    parts: list[torch.Tensor] = [inc.buf[: cuts[1]]]
    posted: list[dist.Work | None] = [None]  # part 0 is in already
    for k in range(1, len(cuts) - 1):
        part = dests.get(k)
        if part is None:  # into buf: its pages are new
            part = inc.buf[cuts[k] : cuts[k + 1]]
            _fault_in(part)
        parts.append(part)
        posted.append(dist.irecv(part, group=pg, group_src=inc.src))
    return parts, posted


def _post_sends(
    pg: dist.ProcessGroup, sends: Sequence[Outgoing], keep: list[torch.Tensor]
) -> list[dist.Work | None]:
    """Post every send at once: header, part boundaries, parts. The small tensors it makes are
    appended to `keep`, which the caller holds until the sends complete."""
    works: list[dist.Work | None] = []
    for s in sends:
        cuts = part_bounds(s.nbytes, s.parsed) if s.buf is not None else []
        n = s.nbytes if s.buf is not None else -1
        head = torch.tensor([s.step, s.owner, s.world, n, s.checksum, len(cuts) - 1])
        keep.append(head)
        works.append(dist.isend(head, group=pg, group_dst=s.dst))
        if s.buf is not None:
            keep.append(torch.tensor(cuts))
            works.append(dist.isend(keep[-1], group=pg, group_dst=s.dst))
            for a, z in itertools.pairwise(cuts):
                works.append(dist.isend(s.buf[a:z], group=pg, group_dst=s.dst))
    return works


def _fault_in(part: torch.Tensor) -> None:
    """Touch one byte per page, so the receive copies into pages that exist.

    Receiving 1 GiB on gloo loopback into a new buffer took 0.64-3.3 s on this project's machine,
    against 0.49-0.52 s when each 32 MiB part was touched just before its receive was posted
    (two ranks, isend/irecv in a throwaway script; the faults are then taken by this thread,
    between receives, not inside the socket copy). On memory already faulted in it costs one
    store per page.
    """
    part[:: mmap.PAGESIZE].zero_()


def _wait_all(works: Sequence[dist.Work | None]) -> None:
    for w in works:
        _wait(w)


def _wait(work: dist.Work | None) -> None:
    if work is not None:  # None only when this rank is not in the group
        work.wait()
