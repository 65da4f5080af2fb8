"""The launch id: node 0's launcher draws it and publishes it (``TOKEN_KEY``, sealed with the
job's secret); the other launchers wait for it. Every other control value is sealed with a key
derived from it (``launch_sealer``), so no value of another launch verifies."""

from __future__ import annotations

import json
import time
import uuid

from restartable.checkpoint.sealing import Sealer
from restartable.inprocess.clock import Clock
from restartable.inprocess.launch.node_lost import NodeLostError, store_lost
from restartable.inprocess.protocol.store import Store

TOKEN_KEY = "launch/token"  # with etcd: {"id": launch id, "t": time.time() when drawn}
_POLL_S = 0.05  # how often a launcher looks for node 0's token


def new_launch_id(clock: Clock) -> str:
    """A fresh launch id, readable in a directory listing: ``20261122-203815-1a2b3c``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(clock.wall())) + "-" + uuid.uuid4().hex[:6]


def launch_sealer(root: Sealer, launch_id: str) -> Sealer:
    """The key of one launch's control values, derived from the job's secret and the launch
    id node 0 drew (``TOKEN_KEY``); each round's ranks get one derived from it in turn."""
    return root.derive("launch", launch_id)


def settle_launch_id(
    store: Store, *, node_rank: int, launch_id: str | None, node_timeout: float, clock: Clock
) -> str:
    """The launch id, once per launcher while ``JobControl`` starts. ``store``: the control
    store sealed with the job's secret.

    Node 0 publishes ``launch_id`` (default: a new one); the others block, at most
    ``node_timeout`` (``NodeLostError`` after that), for a token drawn after they started (less
    ``node_timeout`` for clock skew), so a token replayed from an earlier launch that shares
    the secret is not taken (the launch key derives from its id)."""
    if node_rank == 0:
        token = {"id": launch_id or new_launch_id(clock), "t": clock.wall()}
        store.set(TOKEN_KEY, json.dumps(token))
        return str(token["id"])
    # The one wall-clock comparison between hosts, with node_timeout of slack for skew.
    oldest = clock.wall() - node_timeout
    deadline = clock.monotonic() + node_timeout
    while clock.monotonic() < deadline:
        try:
            if store.check([TOKEN_KEY]):
                token = json.loads(store.get(TOKEN_KEY))
                if float(token["t"]) >= oldest:
                    return str(token["id"])
        except Exception as exc:
            raise store_lost(exc) from exc
        clock.sleep(_POLL_S)
    raise NodeLostError(
        f"node 0's launcher did not open the job within --node-timeout ({node_timeout}"
        " s): start it, or check that it uses the same --store and --job-id"
    )
