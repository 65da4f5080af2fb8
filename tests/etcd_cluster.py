"""Start and tear down a real etcd cluster (1 or 3 members) on free loopback ports, for tests.

Uses Debian's ``etcd-server`` binary (``/usr/bin/etcd``, or ``$ETCD_BIN``); ``skip_reason()``
says why the etcd tests cannot run on this host (no binary, no Python client). Each member
runs in its own process group with its data in a temporary directory; ``close()`` kills every
member and removes the directory. Used as a context manager::

    with EtcdCluster(members=3) as cluster:
        store = EtcdStore(cluster.url, prefix="job-1")
        cluster.kill(cluster.leader())   # the others elect a new leader in ~0.5 s
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from restartable.inprocess.etcd.allocation import etcd_argv
from tests.multiproc import free_ports

ETCD_BIN = os.environ.get("ETCD_BIN", "/usr/bin/etcd")
_START_TIMEOUT_S = 30.0


def skip_reason() -> str | None:
    """Why the etcd tests cannot run here, or None when they can."""
    if not os.access(ETCD_BIN, os.X_OK):
        return (
            f"{ETCD_BIN} not found: install Debian's etcd-server (apt-get install etcd-server) "
            "or set ETCD_BIN"
        )
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        return "etcd3gw is not installed: pip install -e '.[etcd]'"
    return None


class EtcdCluster:
    """``members`` etcd processes forming one cluster on 127.0.0.1 (see the module docstring)."""

    def __init__(self, members: int = 3) -> None:
        if members < 1:
            raise ValueError(f"members ({members}) must be >= 1")
        # /dev/shm keeps etcd's fsyncs off the (shared, slow) disk of CI machines.
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.dir = Path(tempfile.mkdtemp(prefix="etcd-test-", dir=base))
        self.names = [f"m{i}" for i in range(members)]
        ports = free_ports(2 * members)
        self.client_ports = dict(zip(self.names, ports[:members], strict=True))
        self.peer_ports = dict(zip(self.names, ports[members:], strict=True))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for n in self.names:
                self._spawn(n)
            self.wait_healthy(self.names, timeout=_START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    # ----- addresses -------------------------------------------------------------------------

    def endpoint(self, name: str) -> str:
        return f"127.0.0.1:{self.client_ports[name]}"

    @property
    def url(self) -> str:
        """``etcd://host:port,host:port,...`` naming every member."""
        return "etcd://" + ",".join(self.endpoint(n) for n in self.names)

    # ----- lifecycle -------------------------------------------------------------------------

    def _spawn(self, name: str) -> None:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        with log:
            self.procs[name] = subprocess.Popen(
                etcd_argv(
                    name,
                    client=f"http://127.0.0.1:{self.client_ports[name]}",
                    peers={n: f"http://127.0.0.1:{self.peer_ports[n]}" for n in self.names},
                    data_dir=self.dir / name,
                    token=self.dir.name,
                    log_level="warn",
                    etcd_bin=ETCD_BIN,
                ),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _status(self, name: str, timeout: float = 1.0) -> dict[str, object] | None:
        """The member's /v3/maintenance/status answer, or None when it does not answer."""
        req = urllib.request.Request(
            f"http://{self.endpoint(name)}/v3/maintenance/status", data=b"{}", method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def wait_healthy(self, names: list[str], *, timeout: float) -> None:
        """Block until every member in ``names`` answers and the cluster has a leader."""
        deadline = time.monotonic() + timeout
        while True:
            statuses = [self._status(n) for n in names]
            if all(s is not None and int(str(s.get("leader", 0))) != 0 for s in statuses):
                return
            for n in names:
                if self.procs[n].poll() is not None:
                    raise RuntimeError(f"etcd member {n} exited: {self.log(n)[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd cluster not healthy within {timeout} s: {statuses}")
            time.sleep(0.05)

    def leader(self) -> str:
        """The name of the current leader (raises when no member knows one)."""
        for n in self.names:
            if self.procs[n].poll() is not None:
                continue
            s = self._status(n)
            if s is None:
                continue
            header = s.get("header", {})
            member_id = header.get("member_id") if isinstance(header, dict) else None
            if member_id is not None and s.get("leader") == member_id:
                return n
        raise RuntimeError("no etcd member reports itself as the leader")

    def kill(self, name: str) -> None:
        """SIGKILL member ``name`` (a crash: no graceful leader transfer)."""
        p = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        """Kill every member and remove the data directory (idempotent)."""
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
