"""``python -m inprocess.launch``: start the ranks of one node and host the job's store.

    python -m inprocess.launch --nproc-per-node 4 train.py --steps 100

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT and INPROCESS_STORE_HOSTED=1; its output lines are prefixed with ``[rank N]``. Unlike
torchrun, a rank that exits does not take its siblings down (srun ``--kill-on-bad-exit=0``
semantics): ``@restartable`` replaces it in place. SIGINT / SIGTERM are forwarded to every rank
(a second one kills them).

Exit status: 0 when the job succeeded, i.e. at least one rank exited 0 and no rank exited with a
non-zero status of its own; a rank killed by a signal (SIGKILL, a watchdog's hard-timeout kill)
while the others finished is a rank the job survived, not a failure. Otherwise the status of the
first rank that failed (so 75 from a preempted job comes through), or 1 if every rank was
killed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import IO

_DEFAULT_PORT = 29500  # torchrun's default, for multi-node jobs that name no port


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m inprocess.launch",
        description="Start the ranks of one node; host the coordination store on node 0.",
    )
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks on this node")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1", help="host of the store (node 0)")
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="store port (default: a free port on one node, 29500 with several nodes)",
    )
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    args = p.parse_args(argv)
    for name in ("nproc_per_node", "nnodes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 1")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank ({args.node_rank}) must be in [0, --nnodes={args.nnodes})")
    if args.nnodes > 1 and args.master_port is None:
        args.master_port = _DEFAULT_PORT
    return args


def rank_env(args: argparse.Namespace, local_rank: int, port: int) -> dict[str, str]:
    """The environment of one rank (the launcher's own environment plus the job variables)."""
    n = args.nproc_per_node
    return {
        **os.environ,
        "RANK": str(args.node_rank * n + local_rank),
        "WORLD_SIZE": str(args.nnodes * n),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(n),
        "GROUP_RANK": str(args.node_rank),
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(port),
        "INPROCESS_STORE_HOSTED": "1",
        # The ranks die with us (the store we host dies with us too): see bind_to_launcher().
        "INPROCESS_LAUNCHER_PID": str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
    }


def job_status(returncodes: Sequence[int]) -> int:
    """The launcher's exit status from the ranks' (see the module docstring for the rule)."""
    own_failures = [rc for rc in returncodes if rc > 0]
    if own_failures:
        return own_failures[0]
    return 0 if any(rc == 0 for rc in returncodes) else 1


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job; returns the exit status (``job_status``)."""
    args = parse_args(argv)
    store = None
    port = args.master_port
    if args.node_rank == 0:
        import torch.distributed as dist  # only the store host needs torch in the launcher

        # The store lives here, outside every training process: losing rank 0 loses no state.
        store = dist.TCPStore(
            "0.0.0.0", port or 0, is_master=True, wait_for_workers=False, use_libuv=True
        )
        port = store.port
    assert port is not None
    out = sys.stdout.buffer
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    signals_seen = 0

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal signals_seen
        signals_seen += 1
        sig = signum if signals_seen == 1 else signal.SIGKILL
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for local in range(args.nproc_per_node):
            p = subprocess.Popen(
                [sys.executable, args.script, *args.args],
                env=rank_env(args, local, port),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C reaches ranks only through us
            )
            procs.append(p)
            assert p.stdout is not None
            rank = args.node_rank * args.nproc_per_node + local
            t = threading.Thread(
                target=_pump, args=(p.stdout, f"[rank {rank}] ".encode(), out, lock), daemon=True
            )
            t.start()
            pumps.append(t)
        codes = [p.wait() for p in procs]
        for t in pumps:
            t.join(5.0)
    finally:
        for p in procs:  # only if the launcher itself failed: never leave ranks behind
            if p.poll() is None:
                p.kill()
        for s, h in old.items():
            signal.signal(s, h)
        del store
    return job_status(codes)


if __name__ == "__main__":
    sys.exit(main())
