"""Issue 47, "no clash with users' module names": a script whose folder (also the current
directory) holds its own ``checkpoint.py``, ``rerun.py``, ``straggler.py``, ``inprocess.py`` and
``examples.py`` starts under the launcher, restarts in place after an exception and exits 0,
while the script's own ``checkpoint`` module is its own file (ours are ``restartable.*``): a
``@restartable`` script, and an unmodified torchrun script whose snapshot helpers live in its
own ``checkpoint.py``."""

from __future__ import annotations

import re
from pathlib import Path

from tests.multiproc import run_job

# The user's files, named as ours were before they moved under ``restartable.``.
_OWN_MODULES = ("checkpoint", "rerun", "straggler", "inprocess", "examples")

# A @restartable script that imports the user's modules and ours side by side. The lines that
# name the user's modules are marked "names: keep" for the rename script (/tmp/s3/rename.py).
_SCRIPT = """
import os

import torch
import torch.distributed as dist

import checkpoint, examples, inprocess, rerun, straggler  # the user's own (names: keep)
from restartable.checkpoint import CheckpointManager
from restartable.inprocess import context, restartable

own = [m.WHO for m in (checkpoint, examples, inprocess, rerun, straggler)]
mgr = CheckpointManager(os.environ["CKPT_DIR"], local_every=1, persistent_every=100)


@restartable(soft_timeout=10.0, hard_timeout=20.0)
def train() -> None:
    ctx = context()
    print(f"iteration {ctx.iteration} rank {ctx.rank} pid {os.getpid()}", flush=True)
    w = torch.zeros(4)
    state = {"w": w}
    start = mgr.load_latest(state) or 0
    for step in range(start + 1, 7):
        dist.all_reduce(w)
        w += 1
        if step == 3 and ctx.iteration == 0 and ctx.rank == 1:
            raise RuntimeError("injected fault at step 3")
        mgr.save(step, state)
    print(f"rank {ctx.rank} iteration {ctx.iteration} resumed at {start} own modules "
          f"{','.join(own)} ours {CheckpointManager.__module__}", flush=True)


train()
mgr.close()
"""
_DONE = re.compile(r"rank (\d) iteration (\d) resumed at (\d+) own modules (\S+) ours (\S+)")
_START = re.compile(r"iteration (\d) rank (\d) pid (\d+)")


def test_a_script_beside_its_own_checkpoint_py_restarts_in_place(tmp_path: Path) -> None:
    for name in _OWN_MODULES:
        (tmp_path / f"{name}.py").write_text(f"WHO = 'user-{name}'\n")
    (tmp_path / "train.py").write_text(_SCRIPT)
    job = run_job(
        ["-m", "restartable.launch", "--nproc-per-node", "2", "train.py"],
        deadline=150,
        cwd=tmp_path,  # the current directory holds them too (sys.path[0] under -m)
        env={"CKPT_DIR": str(tmp_path / "ckpt")},
    )
    assert job.returncode == 0, job.output
    assert "injected fault at step 3" in job.output, job.output
    done = {
        int(r): (int(it), int(at), own, ours) for r, it, at, own, ours in _DONE.findall(job.output)
    }
    assert sorted(done) == [0, 1], job.output
    for iteration, _, own, ours in done.values():
        assert own == ",".join(f"user-{m}" for m in sorted(_OWN_MODULES)), job.output
        assert ours == "restartable.checkpoint.manager", job.output
        assert iteration == 1, job.output  # restarted once
    # Both resumed from the same saved step, after the fault's step 3 began.
    assert done[0][1] == done[1][1] >= 2, job.output
    # In place: each rank's process is the one that ran iteration 0.
    pids = {(int(it), int(r)): pid for it, r, pid in _START.findall(job.output)}
    assert pids[(0, 0)] == pids[(1, 0)] and pids[(0, 1)] == pids[(1, 1)], job.output


# An unmodified torchrun script (module-level, nanoGPT's style): its own group, its own snapshot
# helpers in its own checkpoint.py, TORCHELASTIC_RESTART_COUNT to fault only the first run.
_TORCHRUN_SCRIPT = """
import os

import torch
import torch.distributed as dist

import checkpoint  # the user's own: save / load of the snapshot (names: keep)
import inprocess  # the user's own too (names: keep)

dist.init_process_group(backend="gloo")
rank = dist.get_rank()
restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"start restarts {restarts} rank {rank} pid {os.getpid()}", flush=True)
path = os.environ["SNAPSHOT"]
state = checkpoint.load(path) if os.path.exists(path) else {"step": 0, "w": torch.zeros(4)}
start, w = state["step"], state["w"]
for step in range(start + 1, 7):
    dist.all_reduce(w)
    w += 1
    if step == 3 and restarts == 0 and rank == 1:
        raise RuntimeError("injected fault at step 3")
    if rank == 0:
        checkpoint.save(path, {"step": step, "w": w})
    dist.barrier()
print(f"rank {rank} restarts {restarts} resumed at {start} own {checkpoint.WHO},{inprocess.WHO}",
      flush=True)
dist.destroy_process_group()
"""
_OWN_CHECKPOINT = """
import os

import torch

WHO = "user-checkpoint"


def save(path, obj):
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def load(path):
    return torch.load(path)
"""
_SCRIPT_DONE = re.compile(r"rank (\d) restarts (\d) resumed at (\d+) own (\S+)")
_SCRIPT_START = re.compile(r"start restarts (\d) rank (\d) pid (\d+)")


def test_an_unmodified_torchrun_script_beside_its_own_checkpoint_py_reruns_in_place(
    tmp_path: Path,
) -> None:
    for name in _OWN_MODULES:
        (tmp_path / f"{name}.py").write_text(f"WHO = 'user-{name}'\n")
    (tmp_path / "checkpoint.py").write_text(_OWN_CHECKPOINT)
    (tmp_path / "train.py").write_text(_TORCHRUN_SCRIPT)
    job = run_job(
        ["-m", "restartable.launch", "--nproc-per-node", "2", "train.py"],
        deadline=150,
        cwd=tmp_path,
        env={"SNAPSHOT": str(tmp_path / "snapshot.pt")},
    )
    assert job.returncode == 0, job.output
    assert "injected fault at step 3" in job.output, job.output
    done = {int(r): (int(n), int(at), own) for r, n, at, own in _SCRIPT_DONE.findall(job.output)}
    assert sorted(done) == [0, 1], job.output
    for restarts, at, own in done.values():
        assert (restarts, own) == (1, "user-checkpoint,user-inprocess"), job.output
        assert at >= 2, job.output  # resumed from its own snapshot, not from the start
    pids = {(int(n), int(r)): pid for n, r, pid in _SCRIPT_START.findall(job.output)}
    assert pids[(0, 0)] == pids[(1, 0)] and pids[(0, 1)] == pids[(1, 1)], job.output
