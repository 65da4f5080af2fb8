"""The default process group of one restart iteration, created in that iteration's namespace."""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from restartable.inprocess import _torch_private
from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.protocol import keys

# What a script's own init_process_group call is told (before train() and inside it).
OWN_GROUP_FIX = (
    "@restartable creates each iteration's default process group itself (on the ranks that "
    "train, in a fresh store namespace): delete the init_process_group call (and "
    "destroy_process_group) from the script, or pass init_process_group=False and create "
    "groups yourself over ctx.store; or keep them and drop @restartable: "
    "restartable.inprocess.launch restarts an unmodified torchrun script in place "
    "(docs/script_mode.md)"
)


def group_timeout(config: RestartConfig, backend: str) -> float:
    """Seconds a collective of the iteration's group may block.

    gloo collectives cannot be aborted: one blocked on a peer ends when that peer's group is
    freed, or at this timeout, which is what frees ranks stuck behind a group that something
    still holds (keep it short). Order: soft_timeout < this < hard_timeout. Just above
    soft_timeout, so a hung rank's own monitor (soft_timeout + one check interval) reports first
    and is blamed, not the rank waiting for it; below hard_timeout, because some waits hold the
    GIL (seen: a peer's heartbeat stopped) and the watchdog would kill a healthy rank.
    """
    if backend != "gloo":
        return config.barrier_timeout
    return min(1.25 * config.soft_timeout, (config.soft_timeout + config.hard_timeout) / 2)


def init_iteration_group(
    config: RestartConfig,
    store: dist.Store,
    *,
    iteration: int,
    rank: int,
    world_size: int,
    local_rank: int,
) -> None:
    """Create the default group of ``iteration`` for the active ranks (main thread, blocking).

    Every active rank calls it with its new ``rank``; it returns once all have joined (gloo's
    full-mesh connect). No-op when ``config.init_process_group`` is False.
    """
    if not config.init_process_group:
        return
    backend = config.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    # init_process_group wraps sys.excepthook with a "[rankN]:" prefix each time it is called:
    # once per iteration would stack the prefixes. Keep the process's own hook.
    excepthook = sys.excepthook
    # Group names come from a per-process counter that destroying the default group resets,
    # unless that destroy failed half-way (a restart that interrupted a group's creation on one
    # rank: found by the fault matrix). Ranks whose counters differ wait forever for each
    # other's connect keys; this iteration's keys are under their own prefix, so start at 0.
    if not dist.is_initialized():
        _torch_private.reset_group_counter()
    try:
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(keys.pg_prefix(iteration), store),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=group_timeout(config, backend)),
        )
    finally:
        sys.excepthook = excepthook


def check_no_default_group() -> None:
    """Raise ``ConfigError`` when a default group exists before the restart loop starts (the
    script called ``init_process_group`` itself, torchrun's pattern). Called by the loop once,
    on every rank, before it connects: each rank fails at once with the fix, nothing waits."""
    if dist.is_available() and dist.is_initialized():
        raise ConfigError(
            f"a default process group already exists before train() ran: {OWN_GROUP_FIX}"
        )


def own_group_misuse(exc: BaseException) -> ConfigError | None:
    """The clear error for torch's answer to a second ``init_process_group`` inside ``train()``
    (``ValueError: trying to initialize the default process group twice!``), else None."""
    if isinstance(exc, ValueError) and "default process group twice" in str(exc):
        return ConfigError(f"train() called init_process_group: {OWN_GROUP_FIX}")
    return None
