"""Rank script for the launcher-recovery tests: a small all_reduce loop under ``@restartable``
that checkpoints to a JSON file, resumes from it on every call of ``train()`` (in-process
restart, respawn, in-job restart alike), and loses processes on cue.

    python -m restartable.launch ... tests/dist/workers_launcher_recovery.py '<json options>'
    python tests/dist/workers_launcher_recovery.py two_nodes '<json options>'   # test driver

Files in ``dir``: ``ckpt.json`` (the newest checkpoint, written by ctx.rank 0 with a rename),
``steps.jsonl`` (ctx.rank 0: one line per finished step, with its pid), ``kills.jsonl`` (one line
per planned SIGKILL, written just before it), ``result.<identity>.json`` (train's return value).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


def _append(path: Path, line: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def clean_loss(steps: int, world: int) -> float:
    """The final value of ``total`` in a run without faults."""
    return float(sum(world * (s + 1) for s in range(steps)))


def _waiting_joiners(active: tuple[int, ...]) -> int:
    """Respawned processes registered, alive and not active: the refilled part of the pool."""
    from restartable.checkpoint.sealing import job_sealer
    from restartable.inprocess.protocol import job_keys
    from restartable.inprocess.protocol.sealed_store import seal
    from restartable.inprocess.store_server import client

    # The job's values are sealed (docs/security.md): read them as its processes do.
    raw = client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=10.0)
    store = seal(raw, job_sealer(create=False))
    return len(job_keys.ready_joiners(store) - set(active))


def main(opts: dict[str, Any]) -> None:
    """``opts``: dir, steps, step_time, ckpt_every, config (RestartConfig keywords),
    kills ([{iteration, rank, step}]: SIGKILL ctx.rank at that step, waiting first until a
    respawned process waits in the pool when ``refill``, and until the reserve's warm-up ended
    (its prewarm ran: ``warm`` marker) when ``after_warm``), raise_at ({step, rank, once}: raise at
    that step; rank None: on every rank), crash_respawned (a respawned process exits 3 at
    start-up), respawn_start_delay (a respawned process sleeps that many seconds at start-up:
    a cold start, which the launcher's warm pool otherwise makes a fraction of a second), plain
    (no ``@restartable``: one process group from the environment, as under torchrun)."""
    respawned = bool(os.environ.get("INPROCESS_RESPAWN_GENERATION"))
    if opts.get("crash_respawned") and respawned:
        print("respawned process crashes at start-up (simulated bad environment)", flush=True)
        sys.exit(3)
    if respawned:
        time.sleep(opts.get("respawn_start_delay", 0.0))
    import logging

    import torch
    import torch.distributed as dist

    from restartable.inprocess import restartable
    from restartable.inprocess.context import context

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    d = Path(opts["dir"])
    ckpt = d / "ckpt.json"

    def train() -> dict[str, Any]:
        ctx: Any = _PlainContext() if opts.get("plain") else context()
        state = json.loads(ckpt.read_text()) if ckpt.exists() else {"step": -1, "total": 0.0}
        total = float(state["total"])
        for step in range(state["step"] + 1, opts["steps"]):
            ctx.ping(step)  # the journal's progress (the downtime report)
            time.sleep(opts.get("step_time", 0.0))
            for k in opts.get("kills", []):
                if (k["iteration"], k["rank"], k["step"]) == (ctx.iteration, ctx.rank, step):
                    waiting = 0
                    if k.get("after_warm"):
                        end = time.monotonic() + 120
                        while not (d / "warm").exists():
                            assert time.monotonic() < end, "the reserve did not warm up in 120 s"
                            time.sleep(0.05)
                    if k.get("refill"):
                        end = time.monotonic() + 60
                        while (waiting := _waiting_joiners(ctx.active_ranks)) < 1:
                            assert time.monotonic() < end, "no respawned process joined in 60 s"
                            time.sleep(0.05)
                    _append(
                        d / "kills.jsonl",
                        {
                            **k,
                            "identity": ctx.initial_rank,
                            "waiting_joiners": waiting,
                            "pid": os.getpid(),
                            "time": time.time(),
                        },
                    )
                    os.kill(os.getpid(), signal.SIGKILL)
            r = opts.get("raise_at")
            if r and r["step"] == step and r["rank"] in (None, ctx.rank):  # None: every rank
                marker = d / "raised"
                if not (r.get("once") and marker.exists()):
                    marker.write_text(repr(time.time()))
                    raise RuntimeError(f"simulated bug at step {step}")
            t = torch.full((1,), float(step + 1))
            dist.all_reduce(t)
            total += t.item()
            if ctx.rank == 0:
                _append(
                    d / "steps.jsonl",
                    {
                        "step": step,
                        "pid": os.getpid(),
                        "time": time.time(),
                        "iteration": ctx.iteration,
                    },
                )
                if (step + 1) % opts.get("ckpt_every", 1) == 0:
                    tmp = d / f"ckpt.{os.getpid()}.tmp"
                    tmp.write_text(json.dumps({"step": step, "total": total}))
                    os.replace(tmp, ckpt)
        return {"total": total, "world_size": ctx.world_size, "initial_rank": ctx.initial_rank}

    if opts.get("plain"):
        # torchrun's agent store keeps the keys of earlier attempts: a group built on them after
        # a restart reads its dead predecessors' addresses. A prefix per attempt avoids that.
        import datetime

        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        agent = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=60),
        )
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"attempt{attempt}", agent),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
        result = train()
        dist.destroy_process_group()
    else:
        # CPU tensors: gloo, also on a host with a GPU (the default is nccl there).
        # The reserve's prewarm runs after its first-use imports (inprocess.restart.warmup).
        warm = {"prewarm": lambda: (d / "warm").touch()} if opts.get("mark_warm") else {}
        result = restartable(**{"backend": "gloo", **warm, **opts["config"]})(train)()
    if result is not None:
        (d / f"result.{result['initial_rank']}.json").write_text(json.dumps(result))


class _PlainContext:
    """What the loop reads from ``inprocess.context()``, for a run without ``@restartable``."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.iteration = 0
        self.rank = self.initial_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.active_ranks = tuple(range(self.world_size))
        self.step: int | None = None

    def ping(self, step: int) -> None:
        self.step = step


def two_nodes(opts: dict[str, Any]) -> int:
    """Test driver: two launchers playing two nodes of ``nproc`` ranks on this machine; once
    ``kill_after_step`` is logged (or, with ``kill_when_raised``: that many seconds after the
    job's ``raise_at`` raised), SIGKILL the launcher of node ``kill_node`` (default 1; its
    ranks die with it); print the other node's output and return its status (each node's
    output goes to ``dir/node<n>.log``)."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = Path(opts["dir"])
    procs, logs = [], []
    for node in (0, 1):
        log = open(d / f"node{node}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [
            sys.executable,
            "-m",
            "restartable.launch",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            str(opts["nproc"]),
            "--master-port",
            str(port),
            *opts["launcher_args"],
            __file__,
            json.dumps(opts["job"]),
        ]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    steps = d / "steps.jsonl"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if opts.get("kill_when_raised") is not None:  # mid-restart: the fault is being handled
            if (d / "raised").exists():
                time.sleep(opts["kill_when_raised"])
                break
        else:
            lines = steps.read_text().splitlines() if steps.exists() else []
            if any(json.loads(x)["step"] >= opts["kill_after_step"] for x in lines):
                break
        time.sleep(0.01)
    killed = opts.get("kill_node", 1)  # None: no launcher killed, both end on their own
    if killed is not None:
        procs[killed].kill()
        procs[killed].wait()
    survivors = [n for n in (0, 1) if n != killed]
    try:
        rc = max(procs[n].wait(opts.get("deadline", 90)) for n in survivors)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    for n in survivors:
        sys.stdout.write((d / f"node{n}.log").read_text())
    return rc


if __name__ == "__main__":
    if sys.argv[1] == "two_nodes":
        sys.exit(two_nodes(json.loads(sys.argv[2])))
    main(json.loads(sys.argv[1]))
