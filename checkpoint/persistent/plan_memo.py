"""Reuse of DCP plans and write results between saves whose encoded form did not change.

Between two persistent saves of an unchanged state layout, every rank's DCP local plan, the
global plan and every rank's write results are identical. Decoding them again on rank 0 (about
4000 objects per rank for a 4000-tensor state) is GIL-bound work in the background thread, and
it allocates enough tracked objects to trigger full garbage collections, which hold the GIL for
as long as the heap takes to scan: profiling the writer thread showed this costing more of the
training loop's time than writing the data. Decoded objects are keyed by their encoded bytes
(``checkpoint.plain``; ``load``), so that reuse is correct by construction: equal bytes decode to
equal objects, and
DCP's global planning is a function of the local plans alone (``derive`` keyed by the plans'
bytes). A rank's own local plan is keyed by ``structure`` of the staged tree instead, which
spares computing the plan to compare it.

Owned by one ``PersistentSaver`` and used only by its background worker thread.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from restartable.checkpoint import plain


class PlanMemo:
    """Decoded objects by slot, kept while the slot's bytes stay the same."""

    def __init__(self) -> None:
        self._blobs: dict[Hashable, bytes] = {}
        self._objs: dict[Hashable, Any] = {}
        self._derived: dict[Hashable, tuple[Any, Any]] = {}

    def load(self, slot: Hashable, blob: bytes) -> Any:
        """``plain.loads(blob)``, or the object loaded for ``slot`` last time if ``blob`` is the
        same bytes. Callers must treat the object as read-only."""
        if self._blobs.get(slot) != blob:
            self._objs[slot] = plain.loads(blob)
            self._blobs[slot] = blob
        return self._objs[slot]

    def derive(self, slot: Hashable, key: Any, compute: Any) -> Any:
        """``compute()``'s value for inputs described by ``key``, computed again only when
        ``key`` is not equal to last time's. A failed ``compute`` leaves nothing behind."""
        cached = self._derived.get(slot)
        if cached is not None and cached[0] == key:
            return cached[1]
        self._derived.pop(slot, None)
        value = compute()
        self._derived[slot] = (key, value)
        return value

    def clear(self) -> None:
        """Forget everything (the staging layout was released)."""
        self._blobs.clear()
        self._objs.clear()
        self._derived.clear()


def structure(tree: Any) -> tuple[Any, ...]:
    """What a DCP local save plan depends on, for a staged tree: container kinds and keys, each
    tensor's dtype and shape (and a DTensor's global shape, placements and mesh position), and
    the type of every other leaf. Equal structures give equal plans."""
    import torch

    if isinstance(tree, Mapping):
        return ("d", tuple((k, structure(v)) for k, v in tree.items()))
    if isinstance(tree, (list, tuple)):
        return ("l" if isinstance(tree, list) else "t", tuple(structure(v) for v in tree))
    if isinstance(tree, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(tree, DTensor):
            mesh = tree.device_mesh
            where = (tuple(mesh.shape), tuple(mesh.get_coordinate() or ()), repr(tree.placements))
            return ("D", tree.dtype, tuple(tree.shape), tuple(tree.to_local().shape), where)
        return ("T", tree.dtype, tuple(tree.shape), tuple(tree.stride()))
    return ("o", type(tree).__module__, type(tree).__qualname__)
