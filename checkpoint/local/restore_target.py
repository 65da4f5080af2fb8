"""The state a local-tier restore fills (``checkpoint.local.restore``): its leaves, which of
them this rank's own shard holds, where a copy that arrives lands, and the fill itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from restartable.checkpoint.errors import CheckpointError, ShardingMismatchError
from restartable.checkpoint.local import packing, unpacking, walk
from restartable.checkpoint.local.leaf import Leaf

ReplicatedOwner = Callable[[list[Leaf], int], dict[str, int]]


class IntoState:
    """Where a shard from a peer or the node-local directory lands (parts.Place): its large
    tensors straight into the state's own tensors, which are already in memory, instead of a new
    buffer that must be faulted in and copied out again (on this project's machine, faulting
    1 GiB in took 0.4-2.9 s during a transfer, and the copy out 0.14 s).

    Only used when a persistent checkpoint exists (restore(), min_step set): if the copy then
    fails its checksum, every tensor it wrote is overwritten by the next source or by the
    persistent tier, never left half-restored.
    """

    def __init__(self, leaves: list[Leaf], keep: Callable[[str], bool]) -> None:
        self._leaves = leaves
        self._keep = keep
        self.keys: set[str] = set()  # tensors that arrived in place (the fill skips them)
        self.parsed: packing.Parsed | None = None  # the header of the copy that arrived

    def clear(self) -> None:
        """Before each attempt: what an earlier, rejected copy placed is not this one's."""
        self.keys, self.parsed = set(), None

    def __call__(self, buf: torch.Tensor, cuts: list[int]) -> dict[int, torch.Tensor]:
        try:
            parsed = packing.parse(buf[: cuts[1]])
            todo = unpacking.match(parsed, self._leaves, self._keep)
        except CheckpointError:
            return {}  # a bad header fails the checksum; a mismatch is reported by the fill
        self.parsed = parsed
        index = {c: i for i, c in enumerate(cuts)}
        out: dict[int, torch.Tensor] = {}
        for leaf, src in todo:
            t = leaf.value
            if not isinstance(src, packing.TensorEntry) or t.is_cuda or not t.is_contiguous():
                continue
            if src.nbytes != t.numel() * t.element_size():
                continue  # a corrupt header (the checksum will say so): keep to the buffer
            base = parsed.data_start + src.offset
            first, end = index.get(base), index.get(base + src.nbytes)
            if first is None or end is None or first == 0:
                continue  # not in parts of its own: it lands in buf and is copied by the fill
            flat = t.detach().reshape(-1).view(torch.uint8)
            for k in range(first, end):
                out[k] = flat[cuts[k] - base : cuts[k + 1] - base]
            self.keys.add(leaf.key)
        return out


class Target:
    """The state being restored, walked once a step to restore exists: the walk calls the
    Stateful objects' state_dict(), which may change them (torch's get_state_dict gives an
    empty optimizer its state by taking a step), so a load that finds nothing must not walk."""

    def __init__(
        self,
        state: dict[str, Any],
        rank: int,
        world: int,
        replicated_owner: ReplicatedOwner | None,
        *,
        in_place: bool,
    ) -> None:
        self._rank, self._world = rank, world
        self._statefuls: list[tuple[Any, dict[str, Any]]] = []
        self._leaves = walk.leaves(state, self._statefuls)
        tensors = [x for x in self._leaves if isinstance(x.value, torch.Tensor)]
        self._fully_parallel = replicated_owner is not None
        self._owner = replicated_owner(tensors, world) if replicated_owner is not None else {}
        self.into_state = IntoState(self._leaves, self.keep) if in_place else None

    def keep(self, key: str) -> bool:
        """Whether this rank's own shard holds `key` (fully_parallel splits replicated ones)."""
        return self._owner.get(key, self._rank) == self._rank

    def sharding_mismatch(self, buf: torch.Tensor, parsed: packing.Parsed | None) -> str | None:
        """Why this rank's shard cannot go into the live DTensors (another mesh or placement),
        or None. Reads the header only; writes nothing."""
        try:
            unpacking.match(parsed if parsed is not None else packing.parse(buf), self._leaves)
        except ShardingMismatchError as e:
            return str(e)
        except CheckpointError:
            return None  # another mismatch: the fill reports it, as for plain tensors
        return None

    def fill(
        self, buf: torch.Tensor, parsed: packing.Parsed | None, pg: dist.ProcessGroup | None
    ) -> None:
        """Fill the state from this rank's shard (skipping tensors that arrived in place);
        fully_parallel then broadcasts the replicated parts; Stateful objects load last."""
        done = self.into_state.keys if self.into_state is not None else set()
        keep = lambda k: self.keep(k) and k not in done  # noqa: E731
        unpacking.fill_leaves(buf, self._leaves, keep=keep, parsed=parsed)
        if self._fully_parallel:
            broadcast_replicated(self._leaves, self._owner, pg, self._rank, self._world)
        for obj, sd in self._statefuls:
            obj.load_state_dict(sd)


def broadcast_replicated(
    leaves: list[Leaf],
    owner: dict[str, int],
    pg: dist.ProcessGroup | None,
    rank: int,
    world: int,
) -> None:
    """fully_parallel: every rank broadcasts the replicated tensors it kept, one flat buffer per
    rank (never one collective per tensor)."""
    tensors = [x for x in leaves if isinstance(x.value, torch.Tensor)]
    for q in range(world):
        part = [x for x in tensors if owner.get(x.key) == q]
        if not part or pg is None:
            continue
        layout = packing.ShardLayout.of(part)
        flat = torch.empty(layout.data_nbytes, dtype=torch.uint8)
        if q == rank:
            packing.copy_in(flat, layout, part)
        dist.broadcast(flat, group=pg, group_src=q)
        if q != rank:
            packing.copy_out(flat, layout, part)
