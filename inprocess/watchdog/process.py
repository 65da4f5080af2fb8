"""The watchdog process's side: wait for beats, the rank's death, or the hard timeout; report.

Run as ``python -m inprocess.watchdog ...`` by ``inprocess.watchdog.Watchdog.start()`` only.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from inprocess.watchdog import kill_notice

if TYPE_CHECKING:
    from inprocess.protocol.store import Store

log = logging.getLogger(__name__)

# The pipe protocol. Rank -> watchdog (stdin): one line per heartbeat holding the current
# iteration, prefixed with RESERVE_PREFIX while the rank waits as a reserve, or CLOSE_MESSAGE.
# Watchdog -> rank (stdout): READY_MESSAGE once, when watching.
CLOSE_MESSAGE = b"close\n"
READY_MESSAGE = b"ready\n"
RESERVE_PREFIX = b"r"

_STORE_TIMEOUT_S = 30.0  # connect + report; the watchdog must never outlive its job for long
_DEAD_POLL_S = 0.01  # only where pidfd_open is missing (not Linux >= 5.3)


def main(argv: Sequence[str]) -> int:
    """Watch one rank until it closes us, dies, or stalls; return the process exit status."""
    args = _parse(argv)
    # A scheduler's SIGTERM to every process of the step (Slurm's proctrack/linuxproc) is for
    # the rank, which finishes its step and checkpoints meanwhile: the watchdog must go on
    # watching it. It ends when the rank closes it or dies (or by SIGKILL at the step's end).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _setup_logging(args.logfile, args.initial_rank)
    watched = _Watched(args.pid)
    store = _connect(args)
    _say_ready()
    stdin = sys.stdin.buffer.fileno()
    os.set_blocking(stdin, False)
    iteration = args.iteration
    buffer = b""
    last_beat = time.monotonic()
    while True:
        wait = max(0.0, last_beat + args.hard_timeout - time.monotonic())
        readable, _, _ = select.select([stdin, *watched.fds], [], [], wait)
        # Always drain stdin first: a "close" written just before the rank exited wins over
        # the death notice that arrives with it.
        eof = False
        if stdin in readable:
            chunk, eof = _read_all(stdin)
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line + b"\n" == CLOSE_MESSAGE:
                    log.debug("rank %d closed its watchdog", args.initial_rank)
                    return 0
                reserve = line.startswith(RESERVE_PREFIX)
                try:
                    iteration = int(line[len(RESERVE_PREFIX) :] if reserve else line)
                    args.reserve = reserve
                except ValueError:  # not ours (a stray write): keep watching, it was a beat
                    log.warning("ignoring unexpected input %r", line[:80])
            if lines:
                last_beat = time.monotonic()
        if eof or watched.gone(readable):
            _report(store, args, iteration, "dead", f"rank process {args.pid} disappeared")
            return 0
        if time.monotonic() - last_beat >= args.hard_timeout:
            detail = watched.terminate(args.termination_grace_time)
            _report(
                store,
                args,
                iteration,
                "hard_timeout",
                f"no heartbeat for {args.hard_timeout} s (GIL held or process frozen); {detail}",
            )
            return 0


class _Watched:
    """The rank process: death notification through a pidfd, signals without pid reuse."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd: int | None = None
        self._gone_early = False
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone_early = True  # died before we could watch it: report at once
        except (AttributeError, OSError):
            self._pidfd = None  # no pidfd here: EOF on stdin remains the death signal

    @property
    def fds(self) -> list[int]:
        return [] if self._pidfd is None else [self._pidfd]

    def gone(self, readable: Sequence[int] = ()) -> bool:
        if self._gone_early:
            return True
        if self._pidfd is not None:
            return self._pidfd in readable or _poll_fd(self._pidfd, 0.0)
        return not _alive(self.pid)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)

    def wait_gone(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        if self._pidfd is not None:
            return self._gone_early or _poll_fd(self._pidfd, timeout)
        while time.monotonic() < end:
            if not _alive(self.pid):
                return True
            time.sleep(_DEAD_POLL_S)
        return not _alive(self.pid)

    def terminate(self, grace: float) -> str:
        """SIGCONT + SIGTERM, ``grace`` seconds, then SIGKILL; says which one ended it."""
        log.warning("rank pid %d missed its heartbeat: SIGTERM", self.pid)
        kill_notice.post(self.pid)  # not a preemption notice: see inprocess.watchdog.kill_notice
        try:
            self.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            self.signal(signal.SIGTERM)
            if self.wait_gone(grace):
                return "ended by SIGTERM"
            log.warning("rank pid %d still alive %.1f s after SIGTERM: SIGKILL", self.pid, grace)
            self.signal(signal.SIGKILL)
            if self.wait_gone(_STORE_TIMEOUT_S):
                return f"ended by SIGKILL after {grace} s grace"
            return "still present after SIGKILL (uninterruptible sleep?)"
        finally:
            kill_notice.clear(self.pid)


def _say_ready() -> None:
    # One line on stdout (a pipe to the rank), then stdout points to /dev/null: nothing else
    # may go down that pipe, and fd 1 must stay taken so no socket is ever opened as fd 1.
    with contextlib.suppress(OSError):
        os.write(1, READY_MESSAGE)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def _poll_fd(fd: int, timeout: float) -> bool:
    readable, _, _ = select.select([fd], [], [], timeout)
    return bool(readable)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_all(fd: int) -> tuple[bytes, bool]:
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return data, False
        if not chunk:
            return data, True
        data += chunk


def _connect(args: argparse.Namespace) -> Store | None:
    """A client of the job's store (etcd with ``--store-url``, else the TCPStore) whose values
    are sealed with the job's secret (from the rank, in this process's environment), or None
    when the store cannot be reached (reports are then logged)."""
    from checkpoint.sealing import job_sealer
    from inprocess.protocol.sealed_store import seal

    try:
        sealer = job_sealer(create=False)
    except Exception:
        log.exception("cannot read the job's secret; faults will only be logged")
        return None
    store = _connect_raw(args)
    return None if store is None else seal(store, sealer)


def _connect_raw(args: argparse.Namespace) -> Any:
    if args.store_url is not None:
        try:
            from inprocess.etcd.connect import open_store

            return open_store(args.store_url, job_id=args.job_id, timeout=_STORE_TIMEOUT_S)
        except Exception:
            log.exception("cannot reach the etcd store; faults will only be logged")
            return None
    host, port = args.store_host, args.store_port
    try:
        # Not torch's client: importing torch cost this process ~220 MB and a second (issue 35).
        from inprocess.protocol.tcpstore_client import TCPStoreClient

        return TCPStoreClient(host, port, timeout=_STORE_TIMEOUT_S)
    except Exception:
        log.exception("cannot reach the store at %s:%d; faults will only be logged", host, port)
        return None


def _report(
    store: Store | None, args: argparse.Namespace, iteration: int, kind: str, detail: str
) -> None:
    who = "reserve rank" if args.reserve else "rank"
    log.warning("%s %d iteration %d: %s (%s)", who, args.initial_rank, iteration, kind, detail)
    if store is None:
        store = _connect(args)
    if store is None:
        return
    try:
        from inprocess.protocol.fault_records import record_reserve_gone, report_fault

        if args.reserve:  # a reserve's death must not interrupt the ranks that train
            record_reserve_gone(store, iteration, args.initial_rank)
            return
        report_fault(
            store, iteration=iteration, initial_rank=args.initial_rank, kind=kind, detail=detail
        )
    except Exception:
        log.exception("could not report %s of rank %d to the store", kind, args.initial_rank)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inprocess.watchdog", allow_abbrev=False)
    p.add_argument("--store-host", required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--initial-rank", type=int, required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--iteration", type=int, default=0)
    p.add_argument("--reserve", action="store_true", help="the rank starts as a reserve")
    p.add_argument("--hard-timeout", type=float, required=True)
    p.add_argument("--termination-grace-time", type=float, required=True)
    p.add_argument("--logfile", default=None)
    p.add_argument("--store-url", default=None, help="the etcd store (etcd://...)")
    p.add_argument("--job-id", default=None, help="the job id of the etcd store's keys")
    return p.parse_args(list(argv))


def _setup_logging(logfile: str | None, rank: int) -> None:
    # This is the process's own entry point, so it may configure its handler.
    handler: logging.Handler = (
        logging.FileHandler(logfile) if logfile else logging.StreamHandler(sys.stderr)
    )
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s watchdog[rank {rank}] %(levelname)s %(message)s")
    )
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
