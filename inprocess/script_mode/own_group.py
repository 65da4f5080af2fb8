"""An unmodified script's own ``init_process_group`` call, answered with the iteration's group.

The restart loop creates each iteration's default group itself (a fresh store namespace, a
timeout the monitor can act on, torn down at a fault: ``inprocess.restart.process_group``).
While the script runs, ``torch.distributed.init_process_group`` (both names a script imports
it by) checks that the call agrees with that group and returns: the script's ``env://``
rendezvous, which would reuse the keys of the previous iteration, never runs. The script's
``destroy_process_group()`` of the default group is left to the loop, which tears the group down
when the run ends and frees it off the main thread (``inprocess.restart.abort.GroupReaper``):
freed by the script, the group's last reference went with the script's DDP, whose destructor
then waited for gloo with the GIL held (seen: the hard timeout killed a rank that had finished).
Any other call (a subgroup, another thread: the monitor's abort) is torch's own.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from restartable.inprocess.errors import ConfigError
from restartable.inprocess.script_mode.config_env import CONFIG_ENV

log = logging.getLogger(__name__)


def check_call(
    *, backend: object, rank: int, world_size: int, warn: Callable[[str, str], None]
) -> None:
    """Raise ``ConfigError`` when the script's call contradicts the iteration's group (rank or
    world size given and different); ``warn(key, line)`` once when it asked for a backend the
    group does not use (the group stays what it is)."""
    if not dist.is_initialized():
        raise ConfigError(
            "the script called init_process_group after destroying this iteration's group: "
            "the restart loop creates one group per iteration; call init_process_group once "
            "per run of the script, then destroy_process_group at its end"
        )
    for name, asked, have in (
        ("rank", rank, dist.get_rank()),
        ("world_size", world_size, dist.get_world_size()),
    ):
        if asked not in (-1, None) and asked != have:
            raise ConfigError(
                f"init_process_group({name}={asked}) but this iteration's group has "
                f"{name} {have}: read RANK / WORLD_SIZE from the environment at each run "
                "(the restart loop rewrites them every iteration), not once per process"
            )
    group_backend = str(dist.get_backend())
    if backend is not None and str(backend).lower() != group_backend:
        warn(
            "backend",
            f"the script asked init_process_group for backend {str(backend)!r}; the restart "
            f"loop created this iteration's group with {group_backend!r} (nccl with CUDA, "
            f'else gloo): set {CONFIG_ENV}=\'{{"backend": "{backend}"}}\' to choose',
        )


@contextlib.contextmanager
def iteration_group_answers(warn: Callable[[str, str], None]) -> Iterator[None]:
    """Inside the block, the script's ``init_process_group`` gets the iteration's group (main
    thread, around one run of the script; the loop's own call happens before the block)."""

    def init_process_group(
        backend: object = None,
        init_method: object = None,
        timeout: object = None,
        world_size: int = -1,
        rank: int = -1,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        check_call(backend=backend, rank=rank, world_size=world_size, warn=warn)
        log.debug("the script's init_process_group got the iteration's group")

    real_destroy = dist.destroy_process_group
    main = threading.get_ident()

    def destroy_process_group(group: object = None) -> None:
        if group is None and threading.get_ident() == main:
            log.debug("the script's destroy_process_group() is left to the restart loop")
            return
        real_destroy(group)  # type: ignore[arg-type]

    saved = (
        dist.init_process_group,
        c10d.init_process_group,
        dist.destroy_process_group,
        c10d.destroy_process_group,
    )
    dist.init_process_group = c10d.init_process_group = init_process_group
    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        (
            dist.init_process_group,
            c10d.init_process_group,
            dist.destroy_process_group,
            c10d.destroy_process_group,
        ) = saved
