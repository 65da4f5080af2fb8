"""How the launchers of one job agree on the job's rounds: the store each round's ranks use, and
what happens when a round ends (an in-job restart, or the end of the job with a status).

The control keys live under ``launch/`` (``<ns>`` below) in the control store. Without
``--store``, node 0's launcher hosts it, a TCPStore on ``--master-port``, for the whole job
(round 0's ranks use that store too; every later round gets a fresh store, so no key of an
earlier round is ever read again):

* ``launch/token``         the launch id and when node 0 drew it (JSON; sealed with the job's
                           secret; RESTARTABLE_LAUNCH_ID of every rank). Every other value is
                           sealed with a key derived from that id (``launch_sealer``), each
                           round's ranks with one derived from it and the round
* ``<ns>r{k}/port``        the port of round ``k``'s store (node 0 publishes it)
* ``<ns>r{k}/arrived``     launchers ready to start round ``k`` (all must arrive)
* ``<ns>r{k}/action``      what ends round ``k`` for every node: JSON ``{"kind": "restart" |
                           "end", "status", "reason"}``; first writer wins
* ``<ns>r{k}/live/{n}``    processes node ``n`` still runs or will respawn
* ``<ns>beat/{n}``         node ``n``'s launcher's beat: a value that changes while it runs (a
                           count; the reader times it with its own monotonic clock, so no host
                           compares another host's clock)
* ``<ns>left/{n}``         node ``n``'s launcher is leaving (node 0 waits for the live ones)
* ``<ns>end``              the job's exit status, first launcher to end writes it (read by the
                           ``inprocess.srun_task`` of a launcher that was killed: it stands in for
                           that launcher, beating and leaving in its name, until it read this)

With ``--store etcd://...`` (``store_url``) no launcher hosts anything: the control keys are on
etcd too, in the job's namespace under ``launch/<launch id>/`` (so losing any one node, node 0
included, loses no coordination state), and the ranks' store of round ``k`` is the etcd
namespace ``job_prefix(url, job_id, round_=k)``: every launcher opens its own etcd clients
(``round_store_env`` tells the ranks which namespace). Node 0 deletes the job's stale keys
(a requeued Slurm job keeps its job id) and then publishes ``launch/token`` (the launch id and
when it was drawn); the other launchers wait for a token drawn after they started (less
``node_timeout`` of clock skew), so they never join a crashed earlier run's keys. The last
launcher to leave deletes every key of the job (``leave``): a launcher counts as gone when it
left, or when its beat did not change for ``beat_stale`` seconds of the reader's own monotonic
clock (never by comparing the wall clocks of two hosts: 2 s of skew would have deleted a live
node's keys).
"""

from __future__ import annotations

import datetime
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from checkpoint.sealing import SECRET_ENV, ForgedValueError, Sealer
from inprocess.clock import SYSTEM, Clock
from inprocess.launch.autoresume import EXIT_APPLICATION, EXIT_REQUEUE
from inprocess.protocol.sealed_store import seal
from inprocess.store_server import listening_server

log = logging.getLogger(__name__)

TOKEN_KEY = "launch/token"  # with etcd: {"id": launch id, "t": time.time() when drawn}


def new_launch_id() -> str:
    """A fresh launch id, readable in a directory listing: ``20261122-203815-1a2b3c``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def launch_sealer(root: Sealer, launch_id: str) -> Sealer:
    """The key of one launch's control values, derived from the job's secret and the launch
    id node 0 drew (``TOKEN_KEY``); each round's ranks get one derived from it in turn."""
    return root.derive("launch", launch_id)


class NodeLostError(Exception):
    """Another launcher (a node) did not answer in time, or node 0's store is gone."""


@dataclass(frozen=True)
class Action:
    """What ends a round on every node: ``kind`` "restart" (round k+1 follows) or "end"."""

    kind: str
    status: int
    reason: str

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "status": self.status, "reason": self.reason})

    @classmethod
    def from_json(cls, text: str) -> Action:
        d = json.loads(text)
        return cls(kind=d["kind"], status=int(d["status"]), reason=d["reason"])


class JobControl:
    """This launcher's side of the control store (node 0 hosts it, or the etcd cluster holds
    it with ``store_url``; close() drops it).

    Call order per round ``k``: ``open_round(k)`` (every launcher; blocks at most
    ``node_timeout`` for the others) -> supervise -> ``request(k, ...)`` by whichever launcher
    decides -> ``action(k)`` read by all. ``leave()`` once at the end.
    """

    def __init__(
        self,
        *,
        node_rank: int,
        nnodes: int,
        addr: str,
        port: int | None,
        node_timeout: float,
        beat_stale: float = 5.0,
        store_url: str | None = None,
        job_id: str | None = None,
        launch_id: str | None = None,
        sealer: Sealer | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        """Connect to (node 0: host, or with etcd: open) the control store and settle the
        launch id: ``launch_id`` on node 0 (default: a new one), node 0's on the others, who
        wait for it at most ``node_timeout`` (``NodeLostError`` after that). ``sealer``: the
        job's secret; every value of the control store and of the round stores is sealed with
        it (``inprocess.protocol.sealed_store``), so a forged action is rejected, never obeyed.
        ``clock``: where this launcher's time comes from (a test skews it)."""
        self._sealer, self.clock = sealer, clock
        self._beats = 0  # this launcher's beat count (report_live)
        # Another launcher's last beat value and when (this clock's monotonic) it changed.
        self._seen: dict[int, tuple[bytes, float]] = {}
        self.node_rank, self.nnodes, self.addr = node_rank, nnodes, addr
        self.node_timeout = node_timeout
        self.store_url, self.job_id = store_url, job_id
        self.beat_stale = beat_stale  # a launcher whose beat is unchanged this long is gone
        self._round_stores: dict[int, Any] = {}
        self.store: Any
        self.ns = "launch/"
        if store_url is not None:
            from inprocess.etcd.connect import open_store

            # Nothing lives on node 0: the control keys are on the etcd cluster too.
            self.port = port or 0
            if node_rank == 0:
                self.delete_job_keys()  # before any rank of this job can exist: only stale keys
            self.store = seal(open_store(store_url, job_id=job_id, timeout=node_timeout), sealer)
            self.launch_id = self._settle_token(launch_id)
            self.ns = f"launch/{self.launch_id}/"
            self._bind_to_launch()
            return
        if node_rank == 0:
            # Outside every training process: losing any rank loses no coordination state.
            self.store = seal(
                listening_server(addr, port or 0, wait_for_workers=False, use_libuv=True), sealer
            )
            self.port = int(self.store.port)
        else:
            assert port is not None
            try:
                self.store = seal(_client(addr, port, node_timeout), sealer)
            except Exception as exc:
                raise _store_lost(exc) from exc
            self.port = port
        self.launch_id = self._settle_token(launch_id)
        self._bind_to_launch()

    def _bind_to_launch(self) -> None:
        """From here on every value is sealed with this launch's own key (``launch_sealer``):
        nothing another launch sealed, even one that shares the secret, verifies."""
        if self._sealer is not None:
            self._sealer = launch_sealer(self._sealer, self.launch_id)
            self.store = seal(self.store.raw, self._sealer)

    def round_sealer(self, k: int) -> Sealer | None:
        """The key of round ``k``'s store and ranks (``round_store_env``); None without one."""
        return None if self._sealer is None else self._sealer.derive("round", str(k))

    def _k(self, name: str) -> str:
        return self.ns + name

    def _settle_token(self, launch_id: str | None) -> str:
        """Node 0 publishes the launch (with etcd after deleting stale keys), sealed with the
        job's secret; the others wait for a token drawn after they started (less
        ``node_timeout`` for clock skew), so a token replayed from an earlier launch that
        shares the secret is not taken (the launch key derives from its id)."""
        if self.node_rank == 0:
            token = {"id": launch_id or new_launch_id(), "t": self.clock.wall()}
            self.store.set(TOKEN_KEY, json.dumps(token))
            return str(token["id"])
        # The one wall-clock comparison between hosts, with node_timeout of slack for skew.
        oldest = self.clock.wall() - self.node_timeout
        deadline = time.monotonic() + self.node_timeout
        while time.monotonic() < deadline:
            try:
                if self.store.check([TOKEN_KEY]):
                    token = json.loads(self.store.get(TOKEN_KEY))
                    if float(token["t"]) >= oldest:
                        return str(token["id"])
            except Exception as exc:
                raise _store_lost(exc) from exc
            time.sleep(0.05)
        raise NodeLostError(
            f"node 0's launcher did not open the job within --node-timeout ({self.node_timeout}"
            " s): start it, or check that it uses the same --store and --job-id"
        )

    # ----- rounds ----------------------------------------------------------------------------

    def open_round(self, k: int) -> tuple[int, Any]:
        """Meet every launcher for round ``k``; returns the round store's port and a client of
        it. Raises ``NodeLostError`` when a launcher does not arrive within ``node_timeout``."""
        try:
            self.store.add(self._k(f"r{k}/arrived"), 1)
            if self.store_url is not None:  # the ranks' store is on etcd; no server anywhere
                round_store, port = self._etcd_round_store(k), self.port
            elif self.node_rank == 0:
                if k == 0:  # round 0's ranks use the control store's server
                    round_store, port = seal(self.store.raw, self.round_sealer(0)), self.port
                else:
                    round_store = self._new_round_store(k)
                    port = int(round_store.port)
                self.store.set(self._k(f"r{k}/port"), str(port))
            deadline = time.monotonic() + self.node_timeout
            while self.store.add(self._k(f"r{k}/arrived"), 0) < self.nnodes:
                if time.monotonic() > deadline:
                    n = self.store.add(self._k(f"r{k}/arrived"), 0)
                    raise NodeLostError(
                        f"only {n} of {self.nnodes} launchers arrived for round {k} within "
                        f"--node-timeout ({self.node_timeout} s): a node is gone"
                    )
                time.sleep(0.05)
            if self.node_rank != 0 and self.store_url is None:
                self.store.wait([self._k(f"r{k}/port")], datetime.timedelta(seconds=30))
                port = int(self.store.get(self._k(f"r{k}/port")))
                raw = self.store.raw if k == 0 else _client(self.addr, port, 30.0)
                round_store = seal(raw, self.round_sealer(k))
        except NodeLostError:
            raise
        except Exception as exc:
            raise _store_lost(exc) from exc
        return port, round_store

    def _new_round_store(self, k: int) -> Any:
        store = seal(
            listening_server(self.addr, 0, wait_for_workers=False, use_libuv=True),
            self.round_sealer(k),
        )
        # The previous round's processes are gone; its store goes (round 0's is the control).
        self._round_stores.pop(k - 1, None)
        self._round_stores[k] = store
        return store

    def _etcd_round_store(self, k: int) -> Any:
        from inprocess.etcd.connect import open_store

        assert self.store_url is not None
        store = seal(
            open_store(self.store_url, job_id=self.job_id, timeout=self.node_timeout, round_=k),
            self.round_sealer(k),
        )
        old = self._round_stores.pop(k - 1, None)
        if old is not None:
            old.close()
        self._round_stores[k] = store
        return store

    def round_store_env(self, k: int) -> dict[str, str]:
        """The ranks' store variables of round ``k``: their key (RESTARTABLE_SECRET, the round's
        own: a value of another launch or round never verifies); with etcd also the
        endpoints (INPROCESS_STORE) and the round's own key namespace (INPROCESS_JOB_ID), so a
        restarted round never reads a key of an earlier one."""
        rs = self.round_sealer(k)
        secret = {} if rs is None else {SECRET_ENV: rs.secret.hex()}
        if self.store_url is None:
            return secret
        from inprocess.etcd.connect import job_prefix
        from inprocess.etcd.url import parse_url

        return {
            **secret,
            "INPROCESS_STORE": parse_url(self.store_url).to_url(),
            "INPROCESS_JOB_ID": job_prefix(self.store_url, self.job_id, round_=k),
        }

    def delete_job_keys(self) -> None:
        """With etcd: delete every key of the job, all rounds and the launchers' (never
        raises). Node 0 before the job starts; the last launcher out at the end."""
        if self.store_url is None:
            return
        from inprocess.etcd.connect import open_store

        try:
            with open_store(self.store_url, job_id=self.job_id, timeout=self.node_timeout) as s:
                n = s.delete_all()
            log.debug("deleted %d keys of job %s on etcd", n, s.prefix)
        except Exception as exc:
            log.warning("could not delete the job's keys on etcd (%s): %r", self.store_url, exc)

    def request(self, k: int, action: Action) -> Action:
        """Propose what ends round ``k``; returns the action that won (first writer)."""
        key = self._k(f"r{k}/action")
        try:
            self.store.compare_set(key, "", action.to_json())
            return Action.from_json(self.store.get(key).decode())
        except Exception as exc:
            raise _store_lost(exc) from exc

    def action(self, k: int) -> Action | None:
        """The action that ends round ``k``, or None while it runs. Raises ``NodeLostError``."""
        key = self._k(f"r{k}/action")
        try:
            return (
                Action.from_json(self.store.get(key).decode()) if self.store.check([key]) else None
            )
        except Exception as exc:
            raise _store_lost(exc) from exc

    def report_live(self, k: int, n: int) -> None:
        """Node's processes still running in round ``k`` (live or due for respawn); also this
        launcher's heartbeat. Raises ``NodeLostError`` when the control store is gone."""
        try:
            self.store.set(self._k(f"r{k}/live/{self.node_rank}"), str(n))
            self._beats += 1
            self.store.set(self._k(f"beat/{self.node_rank}"), str(self._beats))
        except Exception as exc:
            raise _store_lost(exc) from exc

    def job_gone(self, k: int) -> bool:
        """True when every node reported no process left in round ``k``."""
        keys = [self._k(f"r{k}/live/{n}") for n in range(self.nnodes)]
        try:
            if not self.store.check(keys):
                return False
            return all(int(self.store.get(key)) == 0 for key in keys)
        except Exception as exc:
            raise _store_lost(exc) from exc

    def publish_end(self, status: int) -> None:
        """The job ends with ``status`` on this node: publish it (first writer wins; never
        raises) for a killed launcher's ``inprocess.srun_task``."""
        try:
            self.store.compare_set(self._k("end"), "", str(status))
        except Exception as exc:
            log.debug("publishing the end status: %r", exc)

    def leave(self) -> None:
        """This launcher is done (never raises; waits at most ``node_timeout``).

        TCPStore: node 0 waits for the others that are still alive (their beat is fresher than
        ``beat_stale``), so its store outlives every reader. etcd: the last launcher out (every
        other one left, or its beat is stale) deletes every key of the job.
        """
        try:
            self.store.set(self._k(f"left/{self.node_rank}"), "1")
            if self.store_url is not None:
                self._last_out_cleans()
                return
            if self.node_rank != 0:
                return
            deadline = self.clock.monotonic() + self.node_timeout
            waiting = list(range(1, self.nnodes))
            while waiting and self.clock.monotonic() < deadline:
                waiting = [n for n in waiting if self._still_there(n)]
                self.clock.sleep(0.05)
        except Exception as exc:
            log.debug("leaving the control store: %r", exc)

    def _last_out_cleans(self) -> None:
        deadline = self.clock.monotonic() + self.node_timeout
        others = [n for n in range(self.nnodes) if n != self.node_rank]
        cleanup = self._k("cleanup")
        while self.clock.monotonic() < deadline:
            # Another launcher cleans (or did: the token is gone with every other key).
            if self.store.check([cleanup]) or not self.store.check([TOKEN_KEY]):
                return
            others = [n for n in others if self._still_there(n)]
            if not others:
                # Two launchers leaving at once may both see the other gone: one deletes.
                won = self.store.compare_set(cleanup, "", str(self.node_rank))
                if won.decode() == str(self.node_rank):
                    self.delete_job_keys()
                return
            self.clock.sleep(0.05)
        log.warning(
            "node(s) %s still running after --node-timeout (%s s): the job's keys on etcd are "
            "left for them to delete",
            others,
            self.node_timeout,
        )

    def _still_there(self, node: int) -> bool:
        """False once ``node``'s launcher left, or its beat stayed the same for ``beat_stale``
        seconds of this launcher's monotonic clock (from the first time this one read it)."""
        if self.store.check([self._k(f"left/{node}")]):
            return False
        beat = self.store.try_get(self._k(f"beat/{node}"))
        if beat is None:
            return True  # not started yet: the deadline bounds the wait
        now = self.clock.monotonic()
        seen = self._seen.get(node)
        if seen is None or seen[0] != beat:
            self._seen[node] = (beat, now)
            return True
        return now - seen[1] < self.beat_stale

    def close(self) -> None:
        """Drop the stores (node 0: the servers stop; etcd: the clients close)."""
        for store in self._round_stores.values():
            if self.store_url is not None:
                store.close()
        self._round_stores.clear()
        if self.store_url is not None and self.store is not None:
            self.store.close()
        self.store = None


def restart_or_end(k: int, *, max_restarts: int, reason: str, origin: str = "") -> Action:
    """The proposal after the in-process path of round ``k`` stopped: restart while the budget
    (``--max-restarts``) lasts, else end the job asking for a requeue. A stop of ``origin``
    "application" (the same exception at the same place every time: a bug) ends the job with
    ``EXIT_APPLICATION`` at once: a restart or a requeue would only run into it again."""
    if origin == "application":
        return Action(
            "end",
            EXIT_APPLICATION,
            f"{reason}; an application fault (the same exception at the same place each "
            "time): not restarted and not requeued, fix the code and resubmit",
        )
    if k < max_restarts:
        return Action("restart", 0, reason)
    return Action(
        "end",
        EXIT_REQUEUE,
        f"{reason}; in-job restarts exhausted ({k} of --max-restarts {max_restarts})",
    )


def _store_lost(exc: BaseException) -> NodeLostError:
    if isinstance(exc, ForgedValueError):
        return NodeLostError(f"the control store holds a forged value, so the job stops: {exc}")
    return NodeLostError(f"the control store is gone (node 0's launcher, or etcd): {exc}")


def _client(addr: str, port: int, timeout: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        addr,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
