"""The watchdog process on its own: a dummy rank process that exits, is SIGKILLed, holds the GIL,
sleeps, or closes cleanly; faults must land in a real TCPStore (or not at all)."""

from __future__ import annotations

import datetime
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore

from restartable.inprocess.protocol.fault_records import read_faults
from restartable.inprocess.protocol.keys import end_key, gone_ranks
from restartable.inprocess.protocol.store import as_store
from restartable.inprocess.watchdog_owner import Watchdog
from tests.multiproc import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

HARD_TIMEOUT = 1.5
GRACE = 0.5
ITERATION = 4
RANK = 3

# The dummy rank: starts its watchdog, says "ready <watchdog pid>", then does what argv[2] says.
CHILD = textwrap.dedent(
    f"""
    import ctypes, os, sys, time
    from restartable.inprocess.watchdog_owner import Watchdog
    port, mode = int(sys.argv[1]), sys.argv[2]
    w = Watchdog(store_host="127.0.0.1", store_port=port, initial_rank={RANK},
                 hard_timeout={HARD_TIMEOUT}, termination_grace_time={GRACE},
                 heartbeat_interval=0.05, logdir=sys.argv[3] if len(sys.argv) > 3 else None)
    w.start()
    w.set_iteration({ITERATION})
    assert w.wait_ready(30), "the watchdog process did not come up"
    print("ready", w.pid, flush=True)
    if mode == "exit":
        os._exit(3)
    if mode == "reserve_exit":  # dies while waiting as a reserve
        w.set_iteration({ITERATION}, reserve=True)
        os._exit(3)
    if mode == "wait":
        time.sleep(3600)
    if mode == "gil":
        # A foreign C call that never returns and never releases the GIL.
        ctypes.PyDLL(None).sleep(3600)
    if mode == "sleep_then_close":
        time.sleep({2 * HARD_TIMEOUT})  # GIL released: the heartbeat goes on, no kill
        w.close()
        print("closed", flush=True)
    """
)


@pytest.fixture
def store() -> Iterator[TCPStore]:
    s = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=20),
    )
    yield s
    del s


def start_rank(store: TCPStore, mode: str, *extra: str) -> tuple[subprocess.Popen[str], int]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(store.port), mode, *extra],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )
    line = read_line(proc, timeout=30)
    assert line.startswith("ready"), line
    return proc, int(line.split()[1])


def read_line(proc: subprocess.Popen[str], *, timeout: float) -> str:
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], timeout)
    assert readable, f"the dummy rank printed nothing within {timeout} s"
    return proc.stdout.readline().strip()


def wait_fault(store: TCPStore, *, timeout: float) -> tuple[str, str]:
    """(kind, detail) of the fault reported for RANK in ITERATION; waits on the end key."""
    store.wait([end_key(ITERATION)], datetime.timedelta(seconds=timeout))
    faults = read_faults(as_store(store), ITERATION)
    mine = [f for f in faults if f.initial_rank == RANK]
    assert len(mine) == 1, f"expected one fault of rank {RANK}: {faults}"
    return mine[0].kind, mine[0].detail


def wait_gone(pid: int, timeout: float) -> bool:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def test_a_reserves_death_marks_it_gone_and_ends_no_iteration(store: TCPStore) -> None:
    # Issue 35: the ranks that train must not restart because a reserve died.
    proc, watchdog_pid = start_rank(store, "reserve_exit")
    assert proc.wait(10) == 3
    assert wait_gone(watchdog_pid, 10), "the watchdog must exit after its report"
    assert gone_ranks(as_store(store)) == {RANK}
    assert not store.check([end_key(ITERATION)]) and read_faults(as_store(store), ITERATION) == []


def test_sigkill_of_rank_is_reported_within_milliseconds(store: TCPStore) -> None:
    proc, watchdog_pid = start_rank(store, "wait")
    t0 = time.monotonic()
    proc.kill()
    kind, detail = wait_fault(store, timeout=10)
    elapsed = time.monotonic() - t0
    proc.wait()
    assert kind == "dead"
    assert str(proc.pid) in detail
    # Event-driven (pidfd + pipe EOF): milliseconds; the bound is loose for a shared 2-core box.
    assert elapsed < 1.0, f"death reported after {elapsed:.3f} s"
    assert wait_gone(watchdog_pid, 5), "the watchdog outlived its rank"


def test_rank_exiting_without_close_is_reported_dead(store: TCPStore) -> None:
    proc, watchdog_pid = start_rank(store, "exit")
    assert proc.wait(10) == 3
    kind, _ = wait_fault(store, timeout=10)
    assert kind == "dead"
    assert wait_gone(watchdog_pid, 5)


def test_gil_held_hang_is_killed_after_hard_timeout(store: TCPStore, tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc, watchdog_pid = start_rank(store, "gil", str(tmp_path))
    kind, detail = wait_fault(store, timeout=20)
    elapsed = time.monotonic() - t0
    assert kind == "hard_timeout"
    assert "no heartbeat" in detail
    # SIGTERM's default action ends a process even while its main thread holds the GIL.
    assert proc.wait(5) == -signal.SIGTERM
    assert elapsed >= HARD_TIMEOUT
    assert wait_gone(watchdog_pid, 5)
    log = (tmp_path / f"watchdog_rank{RANK}.log").read_text()
    assert "hard_timeout" in log


def test_sleeping_rank_is_not_killed_and_clean_close_reports_nothing(store: TCPStore) -> None:
    proc, watchdog_pid = start_rank(store, "sleep_then_close")
    assert read_line(proc, timeout=20) == "closed"
    assert proc.wait(10) == 0
    assert wait_gone(watchdog_pid, 5), "close() left the watchdog process running"
    assert read_faults(as_store(store), ITERATION) == []


def test_start_waits_until_watching_and_close_is_idempotent(store: TCPStore) -> None:
    w = Watchdog(
        store_host="127.0.0.1",
        store_port=store.port,
        initial_rank=0,
        hard_timeout=5.0,
        termination_grace_time=0.1,
        heartbeat_interval=0.05,
        logdir=None,
    )
    with w:
        w.start()
        assert w.wait_ready(0), "start() returned before the process was watching"
        pid = w.pid
        assert pid is not None
    w.close()
    assert wait_gone(pid, 5)
    assert read_faults(as_store(store), 0) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hard_timeout": 0.0}, r"hard_timeout \(0.0\) must be > 0"),
        ({"heartbeat_interval": 10.0}, r"heartbeat_interval \(10.0\) must be smaller"),
        ({"termination_grace_time": -1.0}, r"termination_grace_time \(-1.0\)"),
        ({"store_port": 0}, r"store_port \(0\)"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict[str, float], message: str) -> None:
    base = {
        "store_host": "127.0.0.1",
        "store_port": 29500,
        "initial_rank": 0,
        "hard_timeout": 5.0,
        "termination_grace_time": 1.0,
        "heartbeat_interval": 0.5,
        "logdir": None,
    }
    with pytest.raises(ValueError, match=message):
        Watchdog(**{**base, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["hard_timeout", "termination_grace_time"])
def test_an_infinite_kill_delay_is_refused(field: str) -> None:
    from restartable.inprocess.watchdog_owner import Watchdog

    kw: dict[str, Any] = {"hard_timeout": 5.0, "termination_grace_time": 1.0}
    kw[field] = float("inf")
    with pytest.raises(ValueError, match=f"{field} \\(inf\\) must be .* finite"):
        Watchdog(store_host="h", store_port=1, initial_rank=0, heartbeat_interval=0.5,
                 logdir=None, **kw)  # fmt: skip


# Runs the watchdog's main in a process that says, once main returned, which heavy modules it
# imported and its peak resident memory (VmHWM: ru_maxrss would carry pytest's over the exec;
# stdout is the rank's pipe: stderr carries the answer).
LEAN_PROBE = (
    "import sys; from restartable.inprocess.watchdog.process import main; rc = main(sys.argv[1:]);"
    "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'));"
    "hwm = [x.split()[1] for x in open('/proc/self/status') if x.startswith('VmHWM')][0];"
    "print('PROBE', rc, len(heavy), hwm, file=sys.stderr)"
)


def test_the_watchdog_process_imports_no_torch_and_stays_small(store: TCPStore) -> None:
    # Issue 35: no torch (it cost ~220 MB and a second of start-up per rank); <= 30 MB.
    watched = subprocess.Popen(["sleep", "0.5"])
    probe = subprocess.run(
        [sys.executable, "-c", LEAN_PROBE, "--store-host=127.0.0.1", f"--store-port={store.port}",
         f"--initial-rank={RANK}", f"--pid={watched.pid}", f"--iteration={ITERATION}",
         "--hard-timeout=30", "--termination-grace-time=1"],
        stdin=subprocess.PIPE, capture_output=True, text=True, timeout=30,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), cwd=REPO_ROOT,
    )  # fmt: skip
    watched.wait()
    (line,) = [x for x in probe.stderr.splitlines() if x.startswith("PROBE")]
    _, rc, heavy, max_rss_kb = line.split()
    assert (rc, heavy) == ("0", "0"), probe.stderr
    assert int(max_rss_kb) <= 30 * 1024, f"watchdog peak RSS {max_rss_kb} KB > 30 MB"
    kind, _ = wait_fault(store, timeout=10)  # the report went through the pure-Python client
    assert kind == "dead"
