"""Rank functions for the exit tests: a process whose background save is in flight at exit."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _manager(root: str) -> Any:
    from restartable.checkpoint import CheckpointManager

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # The store lives in the test process (host_store): a rank's exit does not take it along.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return CheckpointManager(root, persistent_every=1, keep=2, timeout=SAVE_TIMEOUT_S)


SAVE_TIMEOUT_S = 30.0  # the manager's; the exit hang waited this long
# How long rank 0 stays up for rank 1's exit: the whole hang and then some, so the test measures
# a hang's exit too instead of stopping at a guess.
PEER_WAIT_S = SAVE_TIMEOUT_S + 10.0


def abandoned_by_peer(root: str) -> dict[str, Any]:
    """The issue's exit hang: rank 1's save waits on rank 0, which abandons it (a restart took
    its group) and stays alive; rank 1 never closes its manager and returns. It must exit at
    once, saying the save was abandoned, not wait out the save timeout (``SAVE_TIMEOUT_S``).
    Rank 1's file ``rank1.exited`` is touched at its exit (its mtime: when), its result says
    when it returned."""
    done = Path(root) / "rank1.exited"
    # Registered before the manager's exit hook, so it runs after it (atexit is LIFO).
    atexit.register(lambda: done.touch() if dist.is_initialized() and dist.get_rank() else None)
    mgr = _manager(root)
    rank = dist.get_rank()
    state = {"w": torch.arange(8.0)}
    if rank == 0:
        release = threading.Event()
        mgr._persistent._worker.submit(release.wait, 30)  # rank 0's writer is busy elsewhere
        mgr.save(1, state)
        time.sleep(0.5)  # rank 1's writer is now waiting for rank 0's "start"
        dist.destroy_process_group()  # what a restart does to the group the save was on
        mgr._persistent.settle_after_restart()  # the abandon point of the next save/load
        release.set()
        mgr.close()
        end = time.monotonic() + PEER_WAIT_S  # the store (and this rank) up while rank 1 exits
        while not done.exists() and time.monotonic() < end:
            time.sleep(0.05)
        return {"rank1_exited": done.exists()}
    mgr.save(1, state)
    # No close(), no wait(): the interpreter's exit is what must not hang.
    return {"returned_at": time.time()}


def completes_at_exit(root: str) -> dict[str, Any]:
    """Every rank returns with a save in flight and never closes its manager: the exit
    completes the save (every rank still takes part) and says so."""
    mgr = _manager(root)
    mgr.save(3, {"w": torch.full((1024,), float(dist.get_rank()))})
    return {"in_flight": mgr.save_in_flight}


def main() -> None:
    """Run as a script, so that the process ends through a real interpreter exit (atexit,
    thread joins): ``tests._rank_main`` ends with ``os._exit``, which would skip both."""
    import json
    import sys

    mode, root = sys.argv[1], sys.argv[2]
    result = {"abandoned_by_peer": abandoned_by_peer, "completes_at_exit": completes_at_exit}[mode](
        root
    )
    out = Path(os.environ["TEST_RESULT_DIR"]) / f"result.{os.environ['RANK']}.json"
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
