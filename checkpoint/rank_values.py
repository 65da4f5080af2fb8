"""A plain value of the state that differs between ranks: warned once at a persistent save.

The persistent tier keeps one copy of a value outside ``PerRank`` (it is saved as replicated),
so a per-rank value put in the state without ``PerRank`` (``torch.get_rng_state()``, a data
loader's position) comes back identical on every rank, silently. At the first persistent save
of a manager, every rank fingerprints the plain tensors and Python scalars of the state (in
dicts and lists, outside ``PerRank``; modules, optimizers and sharded tensors are their own
business) and the ranks compare the fingerprints: 8 bytes per value, in two small collectives
on the default group, once.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch
import torch.distributed as dist

from checkpoint.per_rank import PerRank

log = logging.getLogger(__name__)

_MAX_BYTES = 16 << 20  # larger tensors are not fingerprinted (a model-sized value is not a RNG)
_SCALARS = (bool, int, float, str, bytes)


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


def differing_plain_values(state: dict[str, Any]) -> list[str]:
    """The paths of the plain values that differ between the ranks of the default group.

    COLLECTIVE on the default group (every rank, same call order); [] without one, with one
    rank, or when the ranks' states do not have the same plain values (nothing to compare).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return []
    values = plain_values(state)
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    paths = _digest("\n".join(p for p, _ in values).encode())
    mine = torch.tensor([paths, *(_fingerprint(v) for _, v in values)], dtype=torch.int64)
    shape = torch.tensor([len(values), -len(values)], device=device)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX)
    if int(shape[0]) != -int(shape[1]) or not values:
        return []
    everyone = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine.to(device))
    rows = torch.stack([t.cpu() for t in everyone])
    if bool((rows[:, 0] != rows[0, 0]).any()):
        return []  # different paths on different ranks
    differs = (rows[:, 1:] != rows[0, 1:]).any(dim=0)
    return [values[i][0] for i in range(len(values)) if bool(differs[i])]


def warn_differing(state: dict[str, Any]) -> None:
    """``differing_plain_values``, then one WARNING (rank 0) naming them and ``PerRank``."""
    paths = differing_plain_values(state)
    if paths and dist.get_rank() == 0:
        log.warning(
            "checkpoint: %s differ%s between ranks but %s not under PerRank: the persistent "
            "tier keeps one copy and every rank restores the same value. Fix: put per-rank "
            "values under PerRank, e.g. state = {..., 'own': PerRank(rng=torch.get_rng_state())}",
            ", ".join(paths),
            "s" if len(paths) == 1 else "",
            "it is" if len(paths) == 1 else "they are",
        )
