"""The fault matrix: which rows exist, how one is played, and what its outcome must be.

A row is a fault kind fired at a phase on a rank in an iteration of ``tests/faults/job.py``
(2 active ranks + 1 warm reserve under ``python -m restartable.launch``), with the model replicated
by DDP or (``extra={"parallel": "fsdp"}``) sharded by FSDP2. Phases, as the job
fires them (the faulting rank fires; its peers go on to wherever the protocol takes them):

* ``startup``     first thing in ``train()``, before any collective of the iteration; in
                  iteration 1 that is during the restart (the peers are joining).
* ``restore``     just before ``load_latest``: the peers are inside its collectives.
* ``step``        at the start of a step.
* ``collective``  after the forward pass: the peers are blocked in backward's all_reduce.
* ``atomic``      inside ``ctx.atomic()`` (the optimizer step).
* ``local_save``  right after ``save()`` returned: the local tier's directory write and its
                  agreement, and every 4th step a persistent save, run in the background.
* ``completion``  after the last step on one rank, 0.3 s after the other returned (it waits in
                  the completion barrier).
* ``persistent:<point>``  SIGKILL in the persistent writer at ``agree``, ``write``,
                  ``before_commit``, ``commit`` or ``retention`` (the checkpoint package's hooks).
* ``reserve``     in the warm reserve while it waits (``prewarm``).
* ``exit``        after ``train()`` returned for good and the manager was closed.

Every row asserts what a user would check: the exit status; restarts happened when the fault
needs one; the final parameters equal a clean run's when the job finished; the newest committed
persistent checkpoint verifies (checksums); no process of the job is left; no checkpoint thread
or extra file descriptor in any process that ended normally; and the wall time bound.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.multiproc import JobOutput, RanksFailed, run_job

JOB = "tests/faults/job.py"
TRAIN_PHASES = ("startup", "restore", "step", "collective", "atomic", "local_save", "completion")
AFTER_RESTART_PHASES = ("startup", "restore", "step")  # also played in iteration 1
PERSISTENT_POINTS = ("agree", "write", "before_commit", "commit", "retention")
RANK0_POINTS = ("commit", "retention")  # only rank 0 commits and deletes old checkpoints
FAULT_STEP = 5  # the step of step-bound phases (a persistent save of step 4 is in flight)
DEADLINE_S = 90.0
PREEMPTED = 75


@dataclass(frozen=True)
class Row:
    """One cell of the matrix and the outcome it must have."""

    kind: str
    phase: str
    rank: int | str  # training rank, "reserve", or an initial rank for "exit"
    iteration: int = 0
    expect: str = "finished"  # "finished" | "preempted" | "stopped" | "store_lost" | "forged"
    extra: dict[str, Any] = field(default_factory=dict)  # more of the row for job.py

    @property
    def id(self) -> str:
        it = f"-it{self.iteration}" if self.iteration else ""
        also = self.extra.get("also")
        pair = f"+{also['kind']}-r{also['rank']}" if also else ""
        pair += "+journal_full" if "journal_tmpfs_kb" in self.extra else ""
        par = f"-{self.extra['parallel']}" if "parallel" in self.extra else ""
        par += f"-{self.extra['scrub']}" if "scrub" in self.extra else ""
        return f"{self.kind}-{self.phase}-r{self.rank}{it}{pair}{par}".replace(":", "_")

    def spec(self) -> dict[str, Any]:
        step_bound = self.phase in ("step", "collective", "atomic", "local_save")
        crash_at = self.phase.partition("persistent:")[2] or None
        return {
            "kind": self.kind,
            "phase": self.phase,
            "rank": self.rank,
            "iteration": self.iteration,
            "step": FAULT_STEP if step_bound else None,
            "precursor": self.iteration == 1,
            "crash_at": crash_at,
            **self.extra,
        }


def full_matrix() -> list[Row]:
    """Every row (``pytest tests/faults --matrix=full``)."""
    rows: list[Row] = []
    for kind in ("exception", "hang", "hang_gil", "kill"):
        for phase in TRAIN_PHASES:
            for rank in (0, 1):
                rows.append(Row(kind, phase, rank))
                # After a restart: the phases a restart runs through, for the kinds that restart
                # in place (exception) and that replace a rank (kill).
                if phase in AFTER_RESTART_PHASES and kind in ("exception", "kill"):
                    rows.append(Row(kind, phase, rank, iteration=1))
    for rank in (0, 1):
        rows += [Row("nan", "step", rank), Row("nan", "step", rank, iteration=1)]
        for phase in ("startup", "step"):
            rows.append(Row("sigterm", phase, rank, expect="preempted"))
        # After the last step the work is done: the job finishes (0), nothing to preempt.
        rows.append(Row("sigterm", "completion", rank, expect="finished"))
        for point in PERSISTENT_POINTS:
            if rank == 0 or point not in RANK0_POINTS:
                rows.append(Row("kill", f"persistent:{point}", rank))
    for kind in ("exception", "kill", "hang", "hang_gil"):
        rows.append(Row(kind, "reserve", "reserve"))
    rows += [
        Row("kill", "exit", 1),
        Row("exception", "exit", 0, expect="finished"),
        # Two faults at once: rank 0 raises while rank 1 is killed, at the same step.
        Row("exception", "step", 0, extra={"also": {"kind": "kill", "rank": 1}}),
        Row("kill", "step", 0, extra={"also": {"kind": "hang", "rank": 1}}),
        # Storage: a corrupt node-local copy of a killed rank (the persistent tier serves), a
        # corrupt newest persistent checkpoint (the one before serves), a full disk.
        Row("corrupt_local", "step", 1),
        Row("corrupt_persistent", "step", 0, extra={"step": 10, "local": False}),
        # A full disk fails the persistent saves on every rank (CheckpointRankError naming
        # ENOSPC), train() restarts from the memory tier, and once retention has freed the
        # space the saves succeed again: the job finishes.
        Row("full_disk", "step", 0, extra={"tmpfs_mb": 2}),
        # The store's host (the launcher) is killed: the job ends, nothing lingers.
        Row("store_loss", "step", 0, expect="store_lost"),
        # The journal's filesystem is full from the start (a tmpfs the test fills): the journal
        # stops with one warning, and the fault is still delivered and the job finishes.
        Row("exception", "step", 0, extra={"journal_tmpfs_kb": 64}),
        # A stranger on the store's port writes an unsealed "done" where the ranks wait for the
        # iteration's outcome: rejected, named, and a fault of that iteration like any other
        # (issue 46: never success unread, never a waiter that stops): the job restarts and
        # trains to its true end.
        Row("forged_value", "step", 0, expect="forged"),
    ]
    # Silent data corruption (a flipped gradient bit) in the step, where gradients are made:
    # found by a warm reserve's re-computation (persistent: the rank retired; transient: kept)
    # or in place (transient only), rolled back to a verified step: the clean run's parameters.
    # Every step is checked, rank 0's at odd steps, rank 1's at even ones: sdc-once hits one.
    for rank in (0, 1):
        at = {"step": FAULT_STEP + rank}
        rows.append(Row("sdc", "step", rank, extra={"scrub": "reserve"}))
        rows.append(Row("sdc-once", "step", rank, extra={"scrub": "reserve", **at}))
        rows.append(Row("sdc-once", "step", rank, extra={"scrub": "in_place"}))
    # The parallelism dimension: the same model sharded with FSDP2 (DTensor state in both tiers,
    # the mesh's groups released at each restart) instead of replicated with DDP.
    for kind in ("exception", "hang", "kill"):
        for phase in ("restore", "step", "local_save"):
            rows.append(Row(kind, phase, 1, extra={"parallel": "fsdp"}))
    return rows


# The rows `pytest` runs by default: one of each kind of outcome and of each mechanism.
SUBSET = (
    "exception-restore-r0",  # the peers are setting up load_latest's group
    "hang_gil-atomic-r1",  # a frozen rank, killed by its watchdog, inside ctx.atomic()
    "kill-persistent_before_commit-r1",  # a rank lost in the persistent writer
    "store_loss-step-r0",  # the store's host is gone: the job ends, nothing lingers
    "kill-local_save-r1-fsdp",  # FSDP2: a reserve takes the killed rank's local shards
)


@dataclass
class Outcome:
    """What one row did (also a line of the summary table)."""

    row: Row
    returncode: int | None
    wall_s: float
    restarts: int
    output: str
    ends: dict[int, dict[str, Any]]
    leftover_pids: list[int]
    hung: bool = False

    def line(self, verdict: str) -> str:
        return (
            f"{self.row.id:40s} {self.row.expect:10s} rc={self.returncode!s:4s} "
            f"restarts={self.restarts} {self.wall_s:5.1f}s {verdict}"
        )


def play(row: Row, tmp: Path) -> Outcome:
    """Run the job for ``row`` in ``tmp`` (bounded by DEADLINE_S) and collect what it left."""
    run_dir = tmp / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = row.spec()
    mounted = _mount_tmpfs(run_dir / "ckpt", spec["tmpfs_mb"]) if "tmpfs_mb" in spec else False
    tag = uuid.uuid4().hex
    env = {"FAULT_ROW": json.dumps(spec), "FAULT_MATRIX_TAG": tag}
    journal_full = "journal_tmpfs_kb" in spec
    if journal_full:
        env["RESTARTABLE_JOURNAL_DIR"] = str(_full_tmpfs(run_dir / "journal", spec))
    argv = ["-m", "restartable.launch", "--nproc-per-node", "3", JOB, "--run-dir", str(run_dir)]
    signal_when = None
    if row.kind == "store_loss":
        import signal

        signal_when = (f"[rank {row.rank}] job: step {FAULT_STEP}", signal.SIGKILL)
    t0 = time.monotonic()
    hung = False
    try:
        job: JobOutput | None = run_job(argv, deadline=DEADLINE_S, env=env, signal_when=signal_when)
        rc, output = job.returncode, job.output
    except RanksFailed as e:
        hung, rc, output = True, None, str(e)
    wall = time.monotonic() - t0
    (tmp / "job.log").write_text(output)  # kept with the run directory, for diagnosis
    leftover = _wait_gone(tag, timeout=10.0)
    ends = {
        int(p.stem): json.loads(p.read_text()) for p in sorted((run_dir / "end").glob("*.json"))
    }
    if mounted:
        subprocess.run(["umount", "-l", str(run_dir / "ckpt")], check=False)
    if journal_full:
        subprocess.run(["umount", "-l", str(run_dir / "journal")], check=False)
    # The iteration train() last ran in, on any rank: the number of in-process restarts.
    iterations = [(e.get("result") or {}).get("iteration", 0) for e in ends.values()]
    restarts = max(iterations, default=0)
    return Outcome(row, rc, wall, restarts, output, ends, leftover, hung)


def _mount_tmpfs(path: Path, size_mb: int) -> bool:
    """A tmpfs of ``size_mb`` at ``path``, private (mode 700: a fresh tmpfs is 1777, which the
    checkpoint root's private-directory check rightly refuses)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=700", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        import pytest

        pytest.skip(f"cannot mount a {size_mb} MiB tmpfs for the full-disk row (needs root)")
    return True


def _full_tmpfs(path: Path, spec: dict[str, Any]) -> Path:
    """A tmpfs of ``journal_tmpfs_kb`` at ``path``, filled: every write there gets ENOSPC."""
    size = int(spec["journal_tmpfs_kb"])
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}k,mode=700", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        import pytest

        pytest.skip(f"cannot mount a {size} KiB tmpfs for the full-journal row (needs root)")
    with contextlib.suppress(OSError), open(path / "filler", "wb") as f:
        while True:
            f.write(b"\0" * 4096)
            f.flush()
    return path


def _tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries ``tag`` (ranks, watchdogs, helpers)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if tag.encode() not in (d / "environ").read_bytes():
                continue
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            pids.append(int(d.name))
    return pids


def _wait_gone(tag: str, timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    pids = _tagged_pids(tag)
    while pids and time.monotonic() < end:
        time.sleep(0.1)
        pids = _tagged_pids(tag)
    for pid in pids:  # never leave them to the next row; the row fails below
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    return pids


def check(out: Outcome, clean_params: list[float] | None, run_dir: Path) -> list[str]:
    """Every way ``out`` falls short of its row's expectation (empty: the row passes)."""
    row, problems = out.row, []
    if out.hung:
        return [f"no exit within {DEADLINE_S:.0f} s (hang)"]
    if out.leftover_pids:
        problems.append(f"processes left behind: {out.leftover_pids}")
    if row.expect == "forged" and "rejected unread" not in out.output:
        problems.append("the forged value is not named in the output")
    if row.expect in ("finished", "forged"):
        if out.returncode != 0:
            problems.append(f"exit status {out.returncode}, expected 0")
        finals = [e["result"]["params"] for e in out.ends.values() if _finished(e)]
        if not finals:
            problems.append("no rank returned a final state")
        elif clean_params is not None and any(p != clean_params for p in finals):
            problems.append("final parameters differ from the clean run's")
        needs_restart = row.phase not in ("reserve", "exit") and row.kind != "sigterm"
        if needs_restart and out.restarts == 0:
            problems.append("no restart logged")
    elif row.expect == "preempted":
        if out.returncode != PREEMPTED:
            problems.append(f"exit status {out.returncode}, expected {PREEMPTED} (preempted)")
    elif row.expect == "stopped":
        if out.returncode in (0, None):
            problems.append(f"exit status {out.returncode}, expected a failure status")
        if "RestartAbortedError" not in out.output and "CheckpointError" not in out.output:
            problems.append("the stop does not name its cause")
    elif row.expect == "store_lost" and out.returncode != -9:
        problems.append(f"exit status {out.returncode}, expected -9 (launcher killed)")
    for rank, end in out.ends.items():
        lingering = [t for t in end["threads"] if t.startswith(("ckpt-", "local-ckpt"))]
        if lingering or end["non_daemon"]:
            problems.append(f"rank {rank}: threads left at exit: {lingering or end['non_daemon']}")
        if end["baseline_fds"] is not None and end["fds"] > end["baseline_fds"] + 2:
            problems.append(f"rank {rank}: {end['fds']} fds at exit vs {end['baseline_fds']}")
    problems += verify_newest(run_dir)
    return problems


def _finished(end: dict[str, Any]) -> bool:
    result = end.get("result")
    return isinstance(result, dict) and "params" in result


def verify_newest(run_dir: Path) -> list[str]:
    """The newest committed persistent checkpoint must verify (every file's checksum)."""
    from restartable.checkpoint.persistent import CheckpointDirs
    from restartable.checkpoint.persistent.load import verify

    dirs = CheckpointDirs(str(run_dir / "ckpt"))
    committed = dirs.list_committed()
    if not committed:
        return []
    bad = verify(dirs, committed[-1], None)
    return [f"newest checkpoint {committed[-1].path} fails verification: {bad}"] if bad else []
