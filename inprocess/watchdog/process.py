"""The watchdog process: wait for beats, the rank's death, or the hard timeout; report.

Run as ``python -m restartable.inprocess.watchdog ...`` by
``inprocess.watchdog_owner.Watchdog.start()`` only. This module does the process's I/O; the decision
is ``inprocess.watchdog.watch.Watch``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from restartable.inprocess.clock import SYSTEM
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.watchdog.pipe import READY_MESSAGE
from restartable.inprocess.watchdog.watch import StoreReport, Watch
from restartable.inprocess.watchdog.watched_rank import WatchedRank

if TYPE_CHECKING:  # imported where used: the client is only needed without --store-url
    from restartable.inprocess.protocol.tcpstore_client import TCPStoreClient

log = logging.getLogger(__name__)

_STORE_TIMEOUT_S = 30.0  # connect + report; the watchdog must never outlive its job for long


def main(argv: Sequence[str]) -> int:
    """Watch one rank until it closes us, dies, or stalls; return the process exit status."""
    args = _parse(argv)
    # A scheduler's SIGTERM to every process of the step (Slurm's proctrack/linuxproc) is for
    # the rank, which finishes its step and checkpoints meanwhile: the watchdog must go on
    # watching it. It ends when the rank closes it or dies (or by SIGKILL at the step's end).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _setup_logging(args.logfile, args.initial_rank)
    clock = SYSTEM  # the process's entry point: everything below takes this clock
    rank = WatchedRank(args.pid, clock=clock)
    store = _connect(args)
    _say_ready()
    watch = Watch(
        initial_rank=args.initial_rank,
        iteration=args.iteration,
        reserve=args.reserve,
        hard_timeout=args.hard_timeout,
        grace=args.termination_grace_time,
        rank=rank,
        report=StoreReport(store, connect=lambda: _connect(args), clock=clock),
        clock=clock,
    )
    _watch(watch, rank)
    return 0


def _watch(watch: Watch, rank: WatchedRank) -> None:
    """The process's loop: wait for input or the rank's death, at most until the hard timeout
    is due, and hand what arrived to ``watch`` until it closes or decided."""
    stdin = sys.stdin.buffer.fileno()
    os.set_blocking(stdin, False)
    while True:
        readable, _, _ = select.select([stdin, *rank.fds], [], [], watch.wait_s())
        chunk, eof = _read_all(stdin) if stdin in readable else (b"", False)
        if watch.step(chunk, eof=eof, gone=eof or rank.gone(readable)) is not None:
            return


def _say_ready() -> None:
    # One line on stdout (a pipe to the rank), then stdout points to /dev/null: nothing else
    # may go down that pipe, and fd 1 must stay taken so no socket is ever opened as fd 1.
    with contextlib.suppress(OSError):
        os.write(1, READY_MESSAGE)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


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
    from restartable.checkpoint.sealing import job_sealer
    from restartable.inprocess.protocol.sealed_store import seal

    try:
        sealer = job_sealer(create=False)
    except Exception:
        log.exception("cannot read the job's secret; faults will only be logged")
        return None
    store = _connect_raw(args)
    return None if store is None else seal(store, sealer)


def _connect_raw(args: argparse.Namespace) -> Store | TCPStoreClient | None:
    """The raw client (``seal`` wraps it), or None when the store cannot be reached."""
    if args.store_url is not None:
        try:
            from restartable.inprocess.etcd.connect import open_store

            return open_store(args.store_url, job_id=args.job_id, timeout=_STORE_TIMEOUT_S)
        except Exception:
            log.exception("cannot reach the etcd store; faults will only be logged")
            return None
    host, port = args.store_host, args.store_port
    try:
        # Not torch's client: importing torch cost this process ~220 MB and a second (issue 35).
        from restartable.inprocess.protocol.tcpstore_client import TCPStoreClient

        return TCPStoreClient(host, port, timeout=_STORE_TIMEOUT_S)
    except Exception:
        log.exception("cannot reach the store at %s:%d; faults will only be logged", host, port)
        return None


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m restartable.inprocess.watchdog", allow_abbrev=False)
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
