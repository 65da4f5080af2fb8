"""Rank functions for the helper's own smoke test."""

from __future__ import annotations

import os
from typing import Any


def allreduce_rank_sum() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"sum": t.item(), "pid": os.getpid()}


def fail_on_rank1() -> None:
    if os.environ["RANK"] == "1":
        raise RuntimeError("boom from rank 1")


def sleep_forever() -> None:
    import time

    time.sleep(3600)


def what_a_fresh_process_sees(*, env_name: str) -> dict[str, Any]:
    """What a rank started as ``python -m tests._rank_main`` must see, forked or not."""
    import sys

    return {
        "pid": os.getpid(),
        "sid": os.getsid(0),
        "pgid": os.getpgid(0),
        "hash": hash("the same string on every rank"),
        "env": os.environ.get(env_name),
        "cwd": os.getcwd(),
        "argv0": sys.argv[0],
        "main": sys.modules["__main__"].__name__,
    }


def kill_self() -> None:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)
