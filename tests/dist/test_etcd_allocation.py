"""``python -m restartable.inprocess.etcd member|wait`` without Slurm: three real members, each on
its own loopback address as on three nodes (SLURMD_NODENAME names the node, as srun sets it),
started, waited for, kept through a job-wide SIGTERM (a preemption notice), stopped and cleaned."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd_cluster import skip_reason
from tests.multiproc import free_port

pytestmark = [
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
    pytest.mark.timeout(120),
]
REPO = Path(__file__).resolve().parents[2]
NODES = ["127.0.0.21", "127.0.0.22", "127.0.0.23"]  # names that resolve to themselves


class Members:
    """One ``member`` process per node, each in its own process group (a step's processes)."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.procs = {n: self._spawn(n) for n in NODES}

    def _spawn(self, node: str) -> subprocess.Popen[str]:
        argv = ["member", "--data-root", str(self.root), "--token", "t-1", *self.where()]
        return subprocess.Popen(
            [sys.executable, "-m", "restartable.inprocess.etcd", *argv],
            env={**os.environ, "SLURMD_NODENAME": node, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def where(self) -> list[str]:
        return ["--nodes", ",".join(NODES), "--port", str(self.port)]

    def wait(self, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return _etcd_cli("wait", *self.where(), "--timeout", str(timeout))

    def signal_all(self, sig: int) -> None:
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)

    def close(self) -> None:
        self.signal_all(signal.SIGKILL)
        for p in self.procs.values():
            p.wait(10)


def _etcd_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "restartable.inprocess.etcd", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.fixture
def members(tmp_path: Path) -> Iterator[Members]:
    m = Members(tmp_path / "etcd-root")
    try:
        yield m
    finally:
        m.close()


def test_members_start_survive_a_job_wide_sigterm_and_stop_clean(members: Members) -> None:
    from restartable.inprocess.etcd import EtcdStore

    up = members.wait()
    url = "etcd://" + ",".join(f"{n}:{members.port}" for n in NODES)
    assert (up.returncode, up.stdout.strip()) == (0, url), up.stderr
    assert "3 member(s) on 127.0.0.21,127.0.0.22,127.0.0.23" in up.stderr
    assert "survives the loss of 1 node(s)" in up.stderr
    with EtcdStore(url, prefix="job-1", timeout=10) as store:
        store.set("step", "40")
    assert sorted(p.name for p in members.root.iterdir()) == NODES  # a data dir per member

    # Slurm's preemption notice reaches every process of the step, etcd included.
    members.signal_all(signal.SIGTERM)
    again = members.wait()
    assert again.returncode == 0, again.stderr
    time.sleep(0.5)
    assert all(p.poll() is None for p in members.procs.values())
    with EtcdStore(url, prefix="job-1", timeout=10) as store:
        assert store.get("step") == b"40"  # restarted on its data: nothing lost

    members.signal_all(signal.SIGUSR2)  # the batch script's stop, as srun relays it
    outs = {n: p.communicate(timeout=30)[0] for n, p in members.procs.items()}
    assert [p.returncode for p in members.procs.values()] == [0, 0, 0], outs
    assert "started again on its data (1/5)" in outs[NODES[0]], outs[NODES[0]]
    assert not members.root.exists()  # every member removed its data, then the root


def test_wait_names_each_member_that_is_not_up(tmp_path: Path) -> None:
    port = str(free_port())
    r = _etcd_cli("wait", "--nodes", "127.0.0.21,127.0.0.22", "--port", port, "--timeout", "1")
    assert r.returncode == 1, r.stderr
    assert "2 members cannot lose either" in r.stderr  # fewer than three: warned at start
    assert "not healthy within 1 s: 127.0.0.21 (127.0.0.21:" in r.stderr
    assert "Connection refused" in r.stderr and "ETCD_START_TIMEOUT" in r.stderr


def test_wait_refuses_an_unbounded_timeout() -> None:
    r = _etcd_cli("wait", "--nodes", "127.0.0.21", "--port", "40000", "--timeout", "inf")
    assert r.returncode == 2, r.stderr
    assert "--timeout (inf) must be a finite number of seconds > 0" in r.stderr
