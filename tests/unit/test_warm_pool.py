"""Issue 35: the launcher's warm pool (inprocess.launch.pool + forkserver) on its own: a rank
forked with torch already imported, its output and exit status; the cold-start fallback when
the server dies; nothing left running after close()."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from restartable.inprocess.launch.pool import WarmPool, wait_ready
from tests.multiproc import REPO_ROOT

pytestmark = pytest.mark.timeout(90)

SCRIPT = textwrap.dedent(
    """
    import os, sys
    print("torch preloaded:", "torch" in sys.modules, "X =", os.environ["X"], "argv", sys.argv[1:])
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "sleep":
        import time; time.sleep(60)
    sys.exit(int(sys.argv[1]))
    """
)


def _started(preload: list[str]) -> WarmPool:
    p = WarmPool(env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, preload=preload)
    p.start()
    assert wait_ready(p, 60), f"the fork server did not come up: {p.broken}"
    return p


@pytest.fixture(scope="module")
def pool() -> Iterator[WarmPool]:
    """One server importing torch for the tests that fork from it (it costs seconds)."""
    p = _started(["torch"])
    yield p
    p.close()


def _script(tmp_path: Path) -> str:
    path = tmp_path / "rank.py"
    path.write_text(SCRIPT)
    return str(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_forked_rank_runs_the_script_with_torch_already_imported(
    pool: WarmPool, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    proc = pool.spawn([_script(tmp_path), "3"], env={**os.environ, "X": "42"})
    assert proc is not None and proc.stdout is not None
    assert proc.wait(30) == 3  # the script's sys.exit status, through the server
    out = proc.stdout.read().decode()
    assert "torch preloaded: True X = 42 argv ['3']" in out and "to stderr" in out, out
    assert time.monotonic() - t0 < 20
    assert proc.poll() == 3


def test_a_forked_rank_has_what_its_first_ddp_imports_and_only_its_own_thread(
    pool: WarmPool, tmp_path: Path
) -> None:
    # Issue 47: a rank forked for a restart or a respawn paid the first DDP's torch._dynamo
    # import (1.1-5.9 s measured) between the fault and its first step. The server imports it
    # on a thread of its own, which has ended before any fork (a fork copies one thread only).
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys, threading\n"
        "print('dynamo', 'torch._dynamo' in sys.modules, 'fsdp', "
        "'torch.distributed.fsdp' in sys.modules, 'threads', threading.active_count())\n"
    )
    proc = pool.spawn([str(script)], env=dict(os.environ))
    assert proc is not None and proc.stdout is not None
    assert proc.wait(60) == 0
    out = proc.stdout.read().decode()
    assert "dynamo True fsdp True threads 1" in out, out


def test_a_killed_rank_reads_as_killed_by_its_signal(pool: WarmPool, tmp_path: Path) -> None:
    proc = pool.spawn([_script(tmp_path), "sleep"], env={**os.environ, "X": "1"})
    assert proc is not None and proc.stdout is not None
    assert proc.stdout.readline().startswith(b"torch preloaded: True")
    with pytest.raises(Exception, match="pid"):
        proc.wait(0.05)  # still running: subprocess.TimeoutExpired
    proc.kill()
    assert proc.wait(10) == -signal.SIGKILL


def test_when_the_server_dies_spawn_falls_back_to_cold_start(tmp_path: Path) -> None:
    pool = _started([])  # its own server: this test kills it
    assert pool.pid is not None
    os.kill(pool.pid, signal.SIGKILL)
    end = time.monotonic() + 10
    while pool.ready() and time.monotonic() < end:
        time.sleep(0.02)
    assert pool.spawn([_script(tmp_path), "0"], env=dict(os.environ)) is None
    assert pool.broken is not None and "exited" in pool.broken
    pool.close()


def test_close_leaves_no_process_behind(tmp_path: Path) -> None:
    p = _started([])
    server = p.pid
    assert server is not None
    child = p.spawn([_script(tmp_path), "sleep"], env={**os.environ, "X": "1"})
    assert child is not None
    child.kill()  # the supervisor stops its ranks before closing the pool
    child.wait(10)
    p.close()
    p.close()  # idempotent
    assert not _alive(server) and not _alive(child.pid)


def test_warming_is_true_only_while_the_server_imports() -> None:
    """The launcher waits for a warming pool before a respawn (POOL_WARMING_WAIT_S) and starts
    cold otherwise: warming() must be False before start, True while the server imports, False
    once it is ready, and False for good once it died."""
    p = WarmPool(env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, preload=["torch"])
    try:
        assert not p.warming(), "a pool not started is not warming"
        p.start()
        # Importing torch (and what a first DDP imports) takes seconds: the first poll after
        # start finds the server alive and not ready yet.
        assert p.warming() and not p.ready()
        assert wait_ready(p, 60), f"the fork server did not come up: {p.broken}"
        assert not p.warming()
        assert p.pid is not None
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while p.broken is None and time.monotonic() < deadline:
            p.ready()  # notices the exit
            time.sleep(0.01)
        assert p.broken is not None and not p.warming()
    finally:
        p.close()
