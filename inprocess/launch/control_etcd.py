"""The ``etcd`` backend of the launchers' coordination (``RoundBackend``, ``--store
etcd://...``): no launcher hosts anything. The control keys are on etcd too, in the job's
namespace under ``launch/<launch id>/`` (losing any one node, node 0 included, loses no
coordination state), and the ranks' store of round ``k`` is the etcd namespace
``job_prefix(url, job_id, round_=k)``: every launcher opens its own etcd clients, and
``round_env`` tells the ranks which namespace. Node 0 deletes the job's stale keys first (a
requeued Slurm job keeps its job id); the last launcher out deletes every key of the job."""

from __future__ import annotations

import logging

from restartable.checkpoint.sealing import Sealer
from restartable.inprocess.etcd.connect import job_prefix, open_store
from restartable.inprocess.etcd.url import parse_url
from restartable.inprocess.launch.control_store import ControlStore
from restartable.inprocess.launch.liveness import Liveness
from restartable.inprocess.protocol.sealed_store import seal
from restartable.inprocess.protocol.store import Store

log = logging.getLogger(__name__)


class EtcdRounds:
    """Every launcher a client of the etcd cluster at ``url``, in ``job_id``'s namespace."""

    name = "etcd"

    def __init__(
        self, *, url: str, job_id: str | None, node_rank: int, port: int | None, node_timeout: float
    ) -> None:
        self.url, self.job_id, self.node_rank = url, job_id, node_rank
        self.node_timeout = node_timeout
        self.port = port or 0  # nothing listens: the ranks' MASTER_PORT is only passed on
        self._control: Store | None = None
        self._rounds: dict[int, Store] = {}  # this launcher's client of the current round

    def open_control(self) -> Store:
        if self.node_rank == 0:
            self.delete_job_keys()  # before any rank of this job can exist: only stale keys
        self._control = open_store(self.url, job_id=self.job_id, timeout=self.node_timeout)
        return self._control

    def namespace(self, launch_id: str) -> str:
        return f"launch/{launch_id}/"

    def host_round(self, k: int, control: ControlStore, sealer: Sealer | None) -> None:
        client = open_store(self.url, job_id=self.job_id, timeout=self.node_timeout, round_=k)
        old = self._rounds.pop(k - 1, None)
        if old is not None:
            old.close()
        self._rounds[k] = seal(client, sealer)

    def join_round(self, k: int, control: ControlStore, sealer: Sealer | None) -> tuple[int, Store]:
        return self.port, self._rounds[k]

    def round_env(self, k: int) -> dict[str, str]:
        """The endpoints (INPROCESS_STORE) and the round's own key namespace
        (INPROCESS_JOB_ID), so a restarted round never reads a key of an earlier one."""
        return {
            "INPROCESS_STORE": parse_url(self.url).to_url(),
            "INPROCESS_JOB_ID": job_prefix(self.url, self.job_id, round_=k),
        }

    def delete_job_keys(self) -> None:
        """Delete every key of the job, all rounds and the launchers' (never raises). Node 0
        before the job starts; the last launcher out at the end."""
        try:
            with open_store(self.url, job_id=self.job_id, timeout=self.node_timeout) as s:
                n = s.delete_all()
            log.debug("deleted %d keys of job %s on etcd", n, s.prefix)
        except Exception as exc:
            log.warning("could not delete the job's keys on etcd (%s): %r", self.url, exc)

    def leave(self, liveness: Liveness) -> None:
        liveness.last_out(self.delete_job_keys)

    def close(self) -> None:
        for store in self._rounds.values():
            store.close()
        self._rounds.clear()
        if self._control is not None:
            self._control.close()
        self._control = None
