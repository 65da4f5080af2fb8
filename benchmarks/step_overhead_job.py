"""One run of ``benchmarks/step_overhead.py``: the example's tiny GPT under DDP, layers switched on.

Started by the driver under ``python -m restartable.launch`` (or ``torchrun`` for ``--layers 0``).
``--layers K`` switches on the first K layers of ``LAYERS``, cumulatively:

    0 plain DDP (the script makes its own process group; no framework code runs)
    1 + @restartable (monitor threads, progress probe, watchdog process and heartbeats, store)
    2 + a warm reserve waiting (the driver starts one process more than --active)
    3 + the re-run machine in validate_results mode (NaN / spiky-loss checks every step)
    4 + local tier in host memory every step
    5 + the node-local directory (local tier also written to disk every step)
    6 + persistent torch_dist checkpoint every --persistent-every steps
    7 + the run journal (the example's full configuration)

Active rank 0 times every step after ``--warmup`` and writes ``steps.json`` to ``--out``.
``--paired-every K`` (layers 4+): the steps save in blocks of K, alternating with blocks of K
that do not, so that one job measures the step with and without its saves on the same machine
state (``saved`` in ``steps.json`` says which steps saved), and each active rank writes
``paired-cpu-<rank>.json``: what saving costs each of its threads and child processes per step
(``BlockCpu``). Every
process (active ranks and reserves) runs a sampler thread that snapshots the CPU time of each of
its threads and child processes (the watchdog) when rank 0 starts the timed window (a marker
file in ``--out``) and when the rank's own timed steps end (a reserve: at rank 0's end marker),
before any group is torn down: ``cpu-<rank>.json`` says who spent what while the steps were timed.
The sampler's own cost is reported too (thread ``bench-sampler``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

LAYERS = (
    "plain DDP",
    "+ @restartable (monitor, probe, watchdog, store)",
    "+ warm reserve waiting",
    "+ re-run machine (validate_results)",
    "+ local tier in memory every step",
    "+ node-local directory every step",
    "+ persistent torch_dist every N",
    "+ run journal",
)
_TICKS = os.sysconf("SC_CLK_TCK")
_SAMPLE_S = 0.05  # how often the sampler looks for rank 0's window markers


def _task_cpu(task: str) -> float:
    """CPU seconds of one thread, ``/proc/<pid>/task/<tid>``: its scheduler run time (ns, from
    ``schedstat``) where the kernel has it, else utime + stime from ``stat`` (in clock ticks,
    10 ms: too coarse for the per-block accounting of ``--paired-every``); 0 when it is gone."""
    try:
        with open(f"{task}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    try:
        with open(f"{task}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _process_cpu(pid: int | str) -> float:
    """CPU seconds of a process's live threads (0 when it is gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    return sum(_task_cpu(f"/proc/{pid}/task/{tid}") for tid in tids)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(entry))
    return out


def cpu_snapshot() -> dict[str, float]:
    """CPU seconds so far of each live thread of this process (by Python name) and of each child
    process (a watchdog: by its command line), plus the process's total (its live threads);
    rank 0 adds the launcher's, which hosts the store every rank talks to."""
    pid = os.getpid()
    names = {t.native_id: t.name for t in threading.enumerate()}
    snap: dict[str, float] = {"process total": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        # Threads Python did not start (gloo's, torch's intra-op pool) have no name: one entry.
        name = names.get(int(tid), "native threads (gloo, torch)")
        if name.startswith("inprocess-monitor-"):  # drop the iteration number: one per rank
            name = name.rsplit("-", 1)[0]
        key = f"thread {name}"
        used = _task_cpu(f"/proc/{pid}/task/{tid}")
        snap[key] = snap.get(key, 0.0) + used
        snap["process total"] += used
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        kind = "watchdog" if "restartable.inprocess.watchdog" in cmd else cmd.split(" ")[-2:][0]
        snap[f"child {kind}"] = snap.get(f"child {kind}", 0.0) + _process_cpu(child)
    launcher = os.environ.get("INPROCESS_LAUNCHER_PID")
    if launcher is not None and os.environ.get("RANK") == "0":  # it hosts the store: count it once
        snap["launcher process (store server)"] = _process_cpu(launcher)
    return snap


def start_sampler(out: Path, rank: int) -> Callable[[], None]:
    """A daemon thread that snapshots at rank 0's window markers and writes cpu-<rank>.json.

    Returns ``end``: an active rank's training thread calls it right after its timed steps, so
    that the closing snapshot is taken before the process group is destroyed. Taken later (the
    end marker is polled), the threads of a group destroyed meanwhile are lost with their CPU:
    plain DDP destroys its group at once, and its gloo threads were missing from its table.
    """
    lock = threading.Lock()
    window: dict[str, Any] = {}

    def end() -> None:
        with lock:
            if "t0" not in window or window.get("done"):
                return
            window["done"] = True
            t1, s1 = time.monotonic(), cpu_snapshot()
        t0, s0 = window["t0"], window["s0"]
        wall = t1 - t0
        # Share of one core while the steps were timed; a thread born in the window counts
        # from 0, one that ended in it is lost (none of the framework's do without a fault).
        used = {k: (s1.get(k, 0.0) - s0.get(k, 0.0)) / wall for k in s1}
        (out / f"cpu-{rank}.json").write_text(json.dumps({"wall_s": wall, "core_share": used}))

    def run() -> None:
        start_marker, end_marker = out / "window.start", out / "window.end"
        while not start_marker.exists():
            time.sleep(_SAMPLE_S)
        with lock:
            window["t0"], window["s0"] = time.monotonic(), cpu_snapshot()
        while not end_marker.exists() and not window.get("done"):
            time.sleep(_SAMPLE_S)
        end()  # a reserve (no steps of its own), or a rank that did not call it

    threading.Thread(target=run, name="bench-sampler", daemon=True).start()
    return end


class BlockCpu:
    """Who spends the CPU that saving costs, per thread and process (``--paired-every K``).

    The training thread calls ``boundary`` between steps, at the start of each block of K
    steps, outside the timed step; each call snapshots the CPU time of every thread and child
    process of this rank (``cpu_snapshot``) and adds the block that just ended to the sums of
    blocks that saved or did not. ``cost_ms`` is then, per name, the CPU per step of the blocks
    that saved minus that of the blocks that did not: what saving costs each thread per step,
    free of the machine's drift (the blocks alternate within one job). Closing a block that
    saved, ``boundary`` first waits for its saves' background work (``settle``: the manager's
    ``wait``), so that work is counted in its own block, not in the next. The benchmark's
    sampler thread is left out: its one snapshot of the window's start is not a save's cost.
    """

    def __init__(self, settle: Callable[[], None]) -> None:
        self._settle = settle
        self._last: dict[str, float] | None = None
        self._block: tuple[int, bool] = (0, False)  # (first step, saves?) of the open block
        self._sums: dict[bool, dict[str, float]] = {True: {}, False: {}}
        self._steps = {True: 0, False: 0}

    def boundary(self, step: int, saving: bool | None) -> None:
        """Close the open block at `step` and open one that saves or not (None: the end)."""
        if self._last is not None and self._block[1]:
            self._settle()
        snap = cpu_snapshot()
        snap["process total"] -= snap.pop("thread bench-sampler", 0.0)
        if self._last is not None:
            start, saved = self._block
            sums = self._sums[saved]
            for k, v in snap.items():
                sums[k] = sums.get(k, 0.0) + v - self._last.get(k, 0.0)
            self._steps[saved] += step - start
        self._last = snap
        if saving is not None:
            self._block = (step, saving)

    def cost_ms(self) -> dict[str, float]:
        """Per thread or process: CPU ms per step saving minus not (empty if either is none)."""
        if not self._steps[True] or not self._steps[False]:
            return {}
        per_step = {
            saved: {k: 1e3 * v / self._steps[saved] for k, v in sums.items()}
            for saved, sums in self._sums.items()
        }
        names = sorted(per_step[True].keys() | per_step[False].keys())
        return {k: per_step[True].get(k, 0.0) - per_step[False].get(k, 0.0) for k in names}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, required=True, choices=range(len(LAYERS)))
    p.add_argument("--active", type=int, required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--persistent-every", type=int, default=50)
    p.add_argument("--paired-every", type=int, default=0, help="0: every step saves")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--parallel", choices=("ddp", "fsdp"), default="ddp", help="examples/parallel.py's shard"
    )
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    rank = int(os.environ["RANK"])
    end_window = start_sampler(args.out, rank)

    import torch
    import torch.distributed as dist
    from gpt import GPTConfig, batch, build_model, corpus
    from parallel import shard
    from state import TrainState

    from restartable.checkpoint import CheckpointManager
    from restartable.inprocess import restartable
    from restartable.rerun import RerunDataIterator, RerunStateMachine

    torch.set_num_threads(1)
    layers = args.layers
    data, cfg = corpus(), GPTConfig()
    mgr = None
    if layers >= 4:
        local_dir = None
        if layers >= 5:
            local_dir = args.out / "local"
            local_dir.mkdir(exist_ok=True)
        mgr = CheckpointManager(
            str(args.out / "ckpt"),
            # "never" within this run unless the persistent layer is on
            persistent_every=args.persistent_every if layers >= 6 else 10**9,
            keep=2,
            local_every=1,
            local_dir=local_dir,
        )

    def loop(rank: int) -> dict[str, Any]:
        rsm = None
        if layers >= 3:
            rsm = RerunStateMachine(
                mode="validate_results",
                check_for_nan_in_loss=True,
                check_for_spiky_loss=True,
                hardware_id=f"cpu-rank{rank}",
            )
        model = build_model(cfg, args.seed)
        ddp = shard(model, args.parallel, world=dist.get_world_size(), device=torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        state = TrainState(model, opt, rsm, rank) if rsm is not None else None
        ckpt = {"train": state}
        times: list[float] = []
        cpu: list[float] = []  # the training thread's own CPU time per step (load-independent)
        saved: list[bool] = []  # whether the step saved (always, unless --paired-every)
        blocks = BlockCpu(mgr.wait) if mgr is not None and args.paired_every else None
        for step in range(args.steps):
            if rank == 0 and step == args.warmup:
                (args.out / "window.start").touch()
            saving = args.paired_every == 0 or (step // args.paired_every) % 2 == 0
            if blocks is not None and step >= args.warmup and step % args.paired_every == 0:
                blocks.boundary(step, saving)
            t0, c0 = time.perf_counter(), time.thread_time()
            xy = batch(
                data, seed=args.seed, step=step, rank=rank, batch_size=args.batch_size, seq=cfg.seq
            )
            if rsm is None:
                opt.zero_grad(set_to_none=True)
                ddp(*xy).backward()
            else:
                batches = RerunDataIterator(iter([xy]))
                while rsm.should_run_forward_backward(batches):
                    opt.zero_grad(set_to_none=True)
                    x, y = next(batches)
                    loss = ddp(x, y)
                    loss.backward()
                    rsm.validate_loss(loss)
            opt.step()
            if mgr is not None and state is not None:
                state.step = step + 1
                if saving:
                    mgr.save(state.step, ckpt)
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
                saved.append(mgr is not None and saving)
        end_window()  # this rank's closing snapshot, while its group's threads still live
        if blocks is not None:
            blocks.boundary(args.steps, None)
            (args.out / f"paired-cpu-{rank}.json").write_text(json.dumps(blocks.cost_ms()))
        if rank == 0:
            (args.out / "window.end").touch()
        if mgr is not None:
            mgr.wait()
        return {"rank": rank, "times": times, "cpu": cpu, "saved": saved}

    if layers == 0:
        hosted = os.environ.get("INPROCESS_STORE_HOSTED") == "1"
        if hosted:  # under inprocess.launch: the launcher's TCPStore, as a client
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
            )
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore("plain/", store),
                rank=rank,
                world_size=int(os.environ["WORLD_SIZE"]),
            )
        else:  # torchrun
            dist.init_process_group("gloo")
        result: dict[str, Any] | None = loop(rank)
        dist.destroy_process_group()
    else:
        from restartable.inprocess import context

        @restartable(
            backend="gloo",  # the plain runs' backend, also on a host with a GPU
            soft_timeout=2.0,
            hard_timeout=5.0,
            heartbeat_interval=0.5,
            active_world_size=args.active,
            journal_dir=str(args.out / "journal") if layers >= 7 else None,
        )
        def train() -> dict[str, Any]:
            return loop(context().rank)

        result = train()
    if mgr is not None:
        mgr.close()
    if result is not None and result["rank"] == 0:
        (args.out / "steps.json").write_text(json.dumps(result))
    # Let the sampler write its file (it wakes within _SAMPLE_S of the end marker).
    deadline = time.monotonic() + 5.0
    while not (args.out / f"cpu-{rank}.json").exists() and time.monotonic() < deadline:
        time.sleep(_SAMPLE_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
