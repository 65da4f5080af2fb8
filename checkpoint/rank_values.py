"""A plain value of the state that differs between ranks: warned once at a persistent save.

The persistent tier keeps one copy of a value outside ``PerRank`` (it is saved as replicated),
so a per-rank value put in the state without ``PerRank`` (``torch.get_rng_state()``, a data
loader's position) comes back identical on every rank, silently. At the first persistent save
of a manager, every rank fingerprints the plain tensors and Python scalars of the state (in
dicts and lists, outside ``PerRank``; modules, optimizers and sharded tensors are their own
business): 8 bytes per value, put in the store; rank 0 compares them at a later save.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import torch
import torch.distributed as dist

from restartable.checkpoint import _torch_private
from restartable.checkpoint.per_rank import PerRank

log = logging.getLogger(__name__)

_MAX_BYTES = 16 << 20  # larger tensors are not fingerprinted (a model-sized value is not a RNG)
_SCALARS = (bool, int, float, str, bytes)
_MAX_LOOKS = 100  # saves after the first persistent one at which rank 0 looks for the others'


def plain_values(state: Any, path: str = "state") -> list[tuple[str, Any]]:
    """``(path, value)`` of the state's plain values, in a deterministic order (pure)."""
    if isinstance(state, PerRank):
        return []
    if isinstance(state, dict):
        out: list[tuple[str, Any]] = []
        for k in sorted(state, key=str):
            out += plain_values(state[k], f"{path}[{k!r}]")
        return out
    if isinstance(state, (list, tuple)):
        return [x for i, v in enumerate(state) for x in plain_values(v, f"{path}[{i}]")]
    if type(state) is torch.Tensor and _fingerprintable(state):  # not a DTensor
        return [(path, state)]
    if isinstance(state, _SCALARS):
        return [(path, state)]
    return []


def _fingerprintable(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and t.device.type != "meta" and t.nbytes <= _MAX_BYTES


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _fingerprint(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        header = str((t.dtype, tuple(t.shape))).encode()
        return _digest(header + t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return _digest(repr(value).encode())


class RankValuesCheck:
    """Names, once, the plain values of the state that differ between ranks (owned by a
    ``CheckpointManager``; its ``save`` calls ``at_save`` on the training thread).

    Never waits on a peer (a save blocks only while it stages): at the first persistent save
    every rank puts its fingerprints in the default group's store (one ``set``); at each later
    save rank 0 looks (one non-blocking ``check``) whether every rank's are there, then
    compares them and warns. It gives up after ``_MAX_LOOKS`` saves (a peer that never got
    there, or a restart: the keys of the next iteration's store are elsewhere).
    """

    def __init__(self) -> None:
        self._done = False
        self._looks = 0
        self._keys: list[str] = []
        self._paths: list[str] = []

    def at_save(self, state: dict[str, Any], *, step: int, persistent: bool) -> None:
        """Publish at the first persistent save (``persistent``), then (rank 0) look."""
        if self._done:
            return
        if not self._keys:
            if persistent:
                self._publish(state, step)
            return
        self._looks += 1
        store = _torch_private.default_store()
        if self._looks > _MAX_LOOKS or not store.check(self._keys):
            self._done = self._looks > _MAX_LOOKS
            return
        self._done = True
        rows = [_parse(store.get(k)) for k in self._keys]
        _warn(_differing(self._paths, rows))

    def _publish(self, state: dict[str, Any], step: int) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            self._done = True
            return
        values = plain_values(state)
        self._paths = [p for p, _ in values]
        mine = [_digest("\n".join(self._paths).encode()), *(_fingerprint(v) for _, v in values)]
        prefix = f"restartable-rank-values/{step}/"
        _torch_private.default_store().set(prefix + str(dist.get_rank()), json.dumps(mine))
        self._keys = [prefix + str(r) for r in range(dist.get_world_size())]
        self._done = dist.get_rank() != 0 or not values


def _parse(raw: bytes) -> list[int]:
    """A rank's fingerprints; [] for anything else (the store's values are not trusted)."""
    try:
        row = json.loads(raw)
    except ValueError:
        return []
    return row if isinstance(row, list) and all(type(x) is int for x in row) else []


def _differing(paths: list[str], rows: list[list[int]]) -> list[str]:
    """The paths whose fingerprints differ between ``rows`` (rank 0's first); [] when the
    ranks' plain values are not the same ones."""
    if any(len(r) != len(paths) + 1 or r[0] != rows[0][0] for r in rows):
        return []
    return [p for i, p in enumerate(paths) if len({r[i + 1] for r in rows}) > 1]


def _warn(paths: list[str]) -> None:
    if paths:
        log.warning(
            "checkpoint: %s differ%s between ranks but %s not under PerRank: the persistent "
            "tier keeps one copy and every rank restores the same value. Fix: put per-rank "
            "values under PerRank, e.g. state = {..., 'own': PerRank(rng=torch.get_rng_state())}",
            ", ".join(paths),
            "s" if len(paths) == 1 else "",
            "it is" if len(paths) == 1 else "they are",
        )
