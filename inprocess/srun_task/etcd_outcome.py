"""A killed launcher's stand-in on etcd (``--store etcd://...``): it beats in the launcher's name
in the launch's control keys until a surviving launcher published the job's end status, then
marks the launcher left and returns that status (``inprocess.srun_task``).

On etcd nothing of the job lived in the killed launcher (node 0's included: the store is the
allocation's etcd cluster), so the other nodes train on and the job can end COMPLETED. The beat
keeps the last launcher out from deleting the job's keys, the end status among them, before this
stand-in read it: it deletes them once every other launcher left or went stale.
"""

from __future__ import annotations

import argparse
import contextlib
import json

from restartable.inprocess.clock import Clock

_POLL_S = 0.5  # how often the stand-in beats and looks for the end status
_CONNECT_S = 30.0  # bounds each etcd request (the client fails over between the members)


def launcher_job_status(a: argparse.Namespace, timeout: float, clock: Clock) -> int | None:
    """The job's end status as the surviving launchers publish it (``JobControl.publish_end``),
    waiting at most ``timeout`` seconds; None when it never came. ``a``: the killed launcher's
    parsed flags (its ``--store``, ``--job-id``, ``--node-rank``)."""
    from restartable.checkpoint.sealing import Sealer
    from restartable.inprocess.etcd.connect import open_store
    from restartable.inprocess.launch.cli import launch_secret
    from restartable.inprocess.launch.launch_id import TOKEN_KEY, launch_sealer
    from restartable.inprocess.protocol.sealed_store import seal

    root = Sealer(launch_secret(a))
    raw = open_store(a.store, job_id=a.job_id, timeout=_CONNECT_S)
    try:
        launch_id = str(json.loads(seal(raw, root).get(TOKEN_KEY))["id"])
        store = seal(raw, launch_sealer(root, launch_id))
        ns = f"launch/{launch_id}/"  # control_etcd.EtcdRounds.namespace
        deadline = clock.monotonic() + timeout
        try:
            while clock.monotonic() < deadline:
                store.set(f"{ns}standin/{a.node_rank}", repr(clock.wall()))
                if store.check([f"{ns}end"]):
                    return int(store.get(f"{ns}end"))
                clock.sleep(_POLL_S)
            return None
        finally:
            with contextlib.suppress(Exception):
                store.set(f"{ns}left/{a.node_rank}", "1")
    finally:
        raw.close()
