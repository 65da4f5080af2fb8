"""Issue 32: the detached store server leaves with its job and is never joined by another one.

Each case runs a real ``inprocess.store_server`` process on a free port (about 2 s: its torch
import)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from restartable.inprocess.errors import ConfigError
from restartable.inprocess.protocol.environment import read_env
from restartable.inprocess.protocol.keys import GONE_KEY
from restartable.inprocess.store_server import client, connect, mark_left
from tests.multiproc import free_port

_EXIT_S = 30.0  # the server polls every second; a loaded machine needs headroom


def _server(port: int, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "restartable.inprocess.store_server",
            "--port",
            str(port),
            "--world-size",
            "2",
            *extra,
        ],
        start_new_session=True,
    )


def _gone(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    try:
        proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture
def port() -> int:
    return free_port()


def test_a_rank_never_joins_another_launchs_store(port: int) -> None:
    # A server of an earlier job (or attempt) still holds the port: the new job's rank 0 cannot
    # start its own there, and every rank must fail naming both, not meet the old keys
    # (before: `connectFullMesh failed` in the new job).
    old = _server(port, "--token", "slurm-7-0")
    try:
        env = read_env(
            {
                "RANK": "1",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "SLURM_JOB_ID": "8",
            }
        )
        with pytest.raises(
            ConfigError,
            match=r"belongs to launch slurm-7-0, not to this launch "
            r"\(slurm-8-0\)",
        ):
            connect(env, timeout=30.0)
        same = read_env(
            {
                "RANK": "1",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RESTARTABLE_LAUNCH_ID": "slurm-7-0",
            }
        )
        connect(same, timeout=30.0)  # its own launch's ranks still get in
    finally:
        old.kill()
        old.wait()


def test_server_ends_when_every_rank_left_or_is_gone_and_ignores_sigterm(port: int) -> None:
    server = _server(port)
    try:
        store = client("127.0.0.1", port, timeout=30.0)
        os.kill(server.pid, signal.SIGTERM)  # Slurm's linuxproc signals every process of a step
        mark_left(store, 0)
        assert mark_left(store, 0) == 1  # idempotent per identity
        assert not _gone(server, 2.5), "the server went before rank 1 left"
        # Rank 1 was SIGKILLed: it never leaves, but its watchdog reported it gone (before:
        # the server waited for its 3600 s idle timeout, past the end of the job).
        store.append(GONE_KEY, "1,")
        assert _gone(server, _EXIT_S)
    finally:
        server.kill()
        server.wait()


def test_under_inprocess_task_the_server_waits_for_the_dead_ranks_task(port: int) -> None:
    server = _server(port, "--wait-for-tasks")
    try:
        store = client("127.0.0.1", port, timeout=30.0)
        mark_left(store, 0)
        store.append(GONE_KEY, "1,")
        # The dead rank's task has not read the job's outcome yet: the store must stay.
        assert not _gone(server, 2.5)
        mark_left(store, 1)  # what inprocess.srun_task does once it knows the outcome
        assert _gone(server, _EXIT_S)
    finally:
        server.kill()
        server.wait()
