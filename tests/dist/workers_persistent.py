"""Rank functions for the persistent-tier multi-process tests (run through tests/multiproc.py)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def _init() -> tuple[int, int]:
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


class Counter:
    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = int(sd["value"])


class Broken:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(f"rank {dist.get_rank()} cannot snapshot")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def _model_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    return model, opt


def _sharded(world: int, *, fill: float | None = None) -> torch.Tensor:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(16 * 4, dtype=torch.float32).reshape(16, 4)
    if fill is not None:
        full = torch.full_like(full, fill)
    return distribute_tensor(full, mesh, [Shard(0)])


def roundtrip(root: str) -> dict[str, Any]:
    """Save model + optimizer + scalar + Stateful + a sharded DTensor; load; compare."""
    import torch.distributed.checkpoint as dcp

    from restartable.checkpoint import CheckpointManager

    _, world = _init()
    model, opt = _model_state(0)
    weight = _sharded(world)
    state = {"model": model, "optim": opt, "counter": Counter(9), "epoch": 3, "w": weight}
    state_dicts = {"model": model.state_dict(), "optim": opt.state_dict()}
    with CheckpointManager(root, persistent_every=5) as mgr:
        mgr.save(5, {**state_dicts, "counter": state["counter"], "epoch": 3, "w": weight})
        weight.to_local().fill_(-1.0)  # mutate right after save() returned
        mgr.wait()
        stats = mgr.last_save
        model2, opt2 = _model_state(1)
        counter2 = Counter(0)
        w2 = _sharded(world, fill=0.0)
        target = {
            "model": model2.state_dict(),
            "optim": opt2.state_dict(),
            "counter": counter2,
            "epoch": 0,
            "w": w2,
        }
        step = mgr.load_latest(target)
        path = mgr.committed()[-1].path
    same_model = all(torch.equal(model2.state_dict()[k], v) for k, v in model.state_dict().items())
    same_optim = all(
        torch.equal(opt2.state_dict()["state"][p]["exp_avg"], s["exp_avg"])
        for p, s in opt.state_dict()["state"].items()
    )
    expected = torch.arange(16 * 4, dtype=torch.float32).reshape(16, 4)
    # Plain DCP load on the training group, no restartable code involved.
    plain = {"w": _sharded(world, fill=0.0), "model": _model_state(2)[0].state_dict()}
    dcp.load(plain, checkpoint_id=path)
    result = {
        "step": step,
        "same_model": same_model,
        "same_optim": same_optim,
        "counter": counter2.value,
        "epoch": target["epoch"],
        "w_ok": torch.equal(w2.full_tensor(), expected),
        "plain_w_ok": torch.equal(plain["w"].full_tensor(), expected),
        "plain_model_ok": torch.equal(plain["model"]["0.weight"], model.state_dict()["0.weight"]),
        "bytes": stats.bytes_written if stats else None,
    }
    dist.destroy_process_group()
    return result


def reshard_save(root: str) -> dict[str, Any]:
    from restartable.checkpoint import CheckpointManager

    _, world = _init()
    with CheckpointManager(root, persistent_every=1) as mgr:
        mgr.save(1, {"w": _sharded(world), "bias": torch.ones(3)})
        mgr.wait()
    dist.destroy_process_group()
    return {"world": world}


def reshard_load(root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from restartable.checkpoint import CheckpointManager

    _, world = _init()
    target = {"w": _sharded(world, fill=0.0), "bias": torch.zeros(3)}
    with CheckpointManager(root, persistent_every=1) as mgr:
        step = mgr.load_latest(target)
        path = mgr.committed()[-1].path
    plain = {"w": _sharded(world, fill=0.0)}
    dcp.load(plain, checkpoint_id=path)
    expected = torch.arange(16 * 4, dtype=torch.float32).reshape(16, 4)
    ok = torch.equal(target["w"].full_tensor(), expected)
    plain_ok = torch.equal(plain["w"].full_tensor(), expected)
    dist.barrier()
    dist.destroy_process_group()
    return {
        "step": step,
        "world": world,
        "ok": ok,
        "plain_ok": plain_ok,
        "bias": target["bias"].tolist(),
    }


def crash_during_save(root: str, point: str, crash_rank: int) -> dict[str, Any]:
    """Commit step 1, then SIGKILL ``crash_rank`` at ``point`` while saving step 2."""
    from restartable.checkpoint import CheckpointError, CheckpointManager
    from restartable.checkpoint.config import ENV_CRASH_AT, ENV_CRASH_RANK

    rank, _ = _init()
    with CheckpointManager(root, persistent_every=1, timeout=10.0) as mgr:
        mgr.save(1, {"x": torch.full((1000,), 1.0)})
        mgr.wait()
    # The hook is read when a manager is built: only the second manager crashes.
    os.environ[ENV_CRASH_AT] = point
    os.environ[ENV_CRASH_RANK] = str(crash_rank)
    error = None
    mgr = CheckpointManager(root, persistent_every=1, timeout=5.0)
    try:
        mgr.save(2, {"x": torch.full((1000,), 2.0)})
        mgr.wait()
    except CheckpointError as e:
        error = str(e)
    finally:
        mgr.close()
    return {"rank": rank, "error": error}


def load_after_crash(root: str) -> dict[str, Any]:
    """Load the newest checkpoint, then save step 3 (whose retention cleans stale partials)."""
    from restartable.checkpoint import CheckpointManager

    rank, _ = _init()
    x = torch.zeros(1000)
    with CheckpointManager(root, persistent_every=1, keep=5) as mgr:
        step = mgr.load_latest({"x": x})
        value = x[0].item()
        mgr.save(3, {"x": x})
        mgr.wait()
        steps = [c.step for c in mgr.committed()]
    dist.destroy_process_group()
    return {"rank": rank, "step": step, "value": value, "steps_after": steps}


def failure_on_one_rank(root: str, bad_rank: int) -> dict[str, Any]:
    from restartable.checkpoint import CheckpointError, CheckpointManager, CheckpointRankError

    rank, _ = _init()
    state: dict[str, Any] = {"x": torch.ones(10)}
    if rank == bad_rank:
        state["b"] = Broken()
    errors = []
    failed: list[int] = []
    with CheckpointManager(root, persistent_every=1, timeout=20.0) as mgr:
        try:
            mgr.save(1, state)
        except CheckpointError as e:
            errors.append(("save", type(e).__name__, str(e)))
        try:
            mgr.wait()
        except CheckpointRankError as e:
            errors.append(("wait", type(e).__name__, str(e)))
            failed = sorted(e.failures)
        steps = [c.step for c in mgr.committed()]
    dist.destroy_process_group()
    return {"rank": rank, "errors": errors, "failed_ranks": failed, "steps": steps}


def many_restarts(root: str, restarts: int) -> dict[str, Any]:
    """Destroy and re-create the default group ``restarts`` times; one manager saves throughout."""
    import threading

    from restartable.checkpoint import CheckpointManager

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0
    )
    counts = []
    loaded = []
    with CheckpointManager(root, persistent_every=1, keep=2, timeout=20.0) as mgr:
        for it in range(restarts):
            dist.init_process_group(
                "gloo", store=dist.PrefixStore(f"iter{it}", store), rank=rank, world_size=world
            )
            x = torch.zeros(4096)
            loaded.append(mgr.load_latest({"x": x}))
            x.fill_(float(it + 1))
            mgr.save(it + 1, {"x": x})
            if it % 2:
                mgr.wait()
            dist.destroy_process_group()
            counts.append((threading.active_count(), len(os.listdir("/proc/self/fd"))))
        mgr.wait()
    return {"rank": rank, "counts": counts, "loaded": loaded}


class _Interrupted(BaseException):
    """What the restart raises into the training thread (a BaseException, as
    ``inprocess.errors.RestartInterrupt``), here by hand, the same way."""


def wait_interrupted(mgr: Any, after_s: float = 0.5) -> None:
    """``mgr.wait()``, ended after ``after_s`` by ``_Interrupted`` raised from a signal handler
    in the main thread, as inprocess.restart.monitor ends it at a restart (its wake-up signal ends a
    blocking wait such as a lock acquire)."""
    import signal

    def fire(signum: int, frame: object) -> None:
        raise _Interrupted

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, after_s)
    try:
        mgr.wait()
    except _Interrupted:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def restart_with_blocked_save(root: str, interrupt_wait: bool = False) -> dict[str, Any]:
    """Rank 0 starts a save that rank 1 never joins (as if rank 1 failed before saving); the
    group is re-created (an in-process restart); the blocked save must be abandoned promptly,
    never become visible, and the manager must go on saving with the new group.

    ``interrupt_wait``: rank 0 is inside ``mgr.wait()`` for that save when the restart
    interrupts it (the fault matrix's lost save: it stayed blocked and every later save queued
    behind it)."""
    import time

    from restartable.checkpoint import CheckpointManager

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0
    )
    x = torch.full((100,), 1.0)
    with CheckpointManager(root, persistent_every=1, timeout=60.0) as mgr:
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("it0", store), rank=rank, world_size=world
        )
        mgr.load_latest({"x": x})  # binds the dedicated group on both ranks
        if rank == 0:
            mgr.save(1, {"x": x})  # blocks in the background: rank 1 never joins
            if interrupt_wait:
                wait_interrupted(mgr)
        dist.barrier()
        dist.destroy_process_group()
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("it1", store), rank=rank, world_size=world
        )
        t0 = time.perf_counter()
        loaded = mgr.load_latest({"x": x})
        settle_s = time.perf_counter() - t0
        mgr.save(2, {"x": torch.full((100,), 2.0)})
        mgr.wait()
        steps = [c.step for c in mgr.committed()]
        # Rank 0's process hosts the store the save's exchange reads: leaving before rank 1's
        # last read of it ended that read with "Connection was likely closed" (once, in a
        # clean-clone CI at load ~7). A launcher's store outlives the ranks; this one does not.
        dist.barrier()
        dist.destroy_process_group()
    return {"rank": rank, "loaded": loaded, "settle_s": settle_s, "steps": steps}


def corrupt_fallback(root: str) -> dict[str, Any]:
    """Two committed steps; rank 0 flips a byte in one of step 2's data files; every rank
    must fall back to step 1 with a WARNING naming the file."""
    import logging
    from pathlib import Path

    from restartable.checkpoint import CheckpointManager

    rank, _ = _init()
    warnings: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("restartable.checkpoint").addHandler(Grab())
    with CheckpointManager(root, persistent_every=1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": torch.full((1000,), float(step)), f"r{rank}": torch.ones(10)})
        mgr.wait()
        newest = Path(mgr.committed()[-1].path)
        victim = sorted(newest.glob("*.distcp"))[-1]
        if rank == 0:
            raw = bytearray(victim.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            victim.write_bytes(bytes(raw))
        dist.barrier()
        x = torch.zeros(1000)
        step = mgr.load_latest({"x": x})
    dist.destroy_process_group()
    return {
        "step": step,
        "value": x[0].item(),
        "victim": victim.name,
        "warned": any(victim.name in w for w in warnings),
    }


def per_rank_restore(*, root: str, wrap: bool) -> dict[str, Any]:
    """docs/checkpoint.md's per-rank example: each rank saves its own RNG state and loader
    position to the persistent tier, a new manager restores them; what each rank got back."""
    from restartable.checkpoint import CheckpointManager, PerRank

    rank, _ = _init()
    torch.manual_seed(100 + rank)
    own = {"rng": torch.get_rng_state(), "position": 10 * (rank + 1)}
    saved = own["rng"].clone()
    state: dict[str, Any] = {"own": PerRank(own) if wrap else own}
    with CheckpointManager(root, persistent_every=1) as mgr:
        mgr.save(1, state)
        mgr.wait()
    torch.manual_seed(0)  # what a fresh process would hold
    fresh = {"rng": torch.get_rng_state(), "position": 0}
    state = {"own": PerRank(fresh) if wrap else fresh}
    with CheckpointManager(root, persistent_every=1) as mgr:
        step = mgr.load_latest(state)
    back = state["own"]
    torch.set_rng_state(back["rng"])
    return {
        "step": step,
        "own_rng": bool(torch.equal(back["rng"], saved)),
        "position": back["position"],
        "draw": torch.rand(1).item(),
        "type": type(state["own"]).__name__,
    }
