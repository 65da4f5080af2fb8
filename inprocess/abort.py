"""Tear down this rank's process groups so that peers blocked on it are released at once."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def abort_process_groups() -> None:
    """Abort (NCCL) and destroy every process group of this rank; never raises.

    Called by the monitor thread when a fault is seen, and by the main thread after ``train()``
    raised, possibly both; the second call finds nothing to do. Gloo collectives cannot be
    aborted from another thread, but destroying the group closes this rank's sockets, and that
    releases every peer blocked on this rank within milliseconds (DESIGN.md). On NCCL the
    communicators are aborted first so that pending kernels stop.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    if torch.cuda.is_available():
        _abort_nccl()
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a group already torn down by the other thread, or broken
        log.debug("destroy_process_group failed (already torn down?): %r", exc)


def _abort_nccl() -> None:
    """Abort the NCCL communicators of every group (the ncclCommAbort path of torch)."""
    try:
        groups = list(dist.distributed_c10d._world.pg_map)
    except Exception:
        return
    for pg in groups:
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except Exception:  # no NCCL backend in this group
            continue
        try:
            backend.abort()
        except Exception as exc:
            log.debug("NCCL abort failed: %r", exc)
