"""The store for a torchrun-launched baseline worker, made to survive torchrun's restarts.

torchrun's agent store keeps the keys of earlier attempts: a group built on them after a restart
reads the addresses its dead predecessors published and gloo's connect is refused (seen here as
``connectFullMesh`` failures). Keys under a per-attempt prefix give the baselines of the
benchmarks a fair, working restart.
"""

from __future__ import annotations

import datetime
import os
from typing import Any


def attempt_store(*, timeout: float) -> tuple[Any, int]:
    """(a store private to this torchrun attempt, the attempt number); pass the store to
    ``init_process_group(store=..., rank=..., world_size=...)``. Call once per worker."""
    import torch.distributed as dist

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    return dist.PrefixStore(f"baseline/attempt{attempt}", agent), attempt
