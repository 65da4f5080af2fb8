"""Submit an example sbatch script to the test cluster and follow it to its end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.slurm_cluster import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"})  # fmt: skip
# The example's small CPU run: timeouts that catch a hang in seconds, frequent checkpoints.
FAST = "--soft-timeout 3 --hard-timeout 8 --persistent-every 20 --log-every 20"


@dataclass
class Job:
    """One submitted job: its id, its output file (every attempt appends) and its cluster."""

    id: str
    output: Path
    cluster: SlurmCluster
    submitted: float = field(default_factory=time.monotonic)

    def info(self) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...)."""
        r = subprocess.run(["scontrol", "show", "job", "-o", self.id], env=self.cluster.env,
                           capture_output=True, text=True, timeout=30)  # fmt: skip
        return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)

    def log(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def wait_end(self, timeout: float) -> dict[str, str]:
        """Block until the job reaches a final state (polling: ``sbatch --wait`` answers up to
        ~30 s late); ``AssertionError`` with the log after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if info.get("JobState") in FINAL_STATES:
                info["wall_s"] = f"{time.monotonic() - self.submitted:.1f}"
                return info
            if time.monotonic() > deadline:
                subprocess.run(["scancel", self.id], env=self.cluster.env, timeout=30)
                raise AssertionError(
                    f"job {self.id} not over after {timeout:.0f} s ({info.get('JobState')}):\n"
                    f"{self.log()[-5000:]}\n{self.cluster.logs(1500)}"
                )
            time.sleep(1.0)

    def wait_output(self, pattern: str, timeout: float, *, after: int = 0) -> re.Match[str]:
        """Block until the output (from character ``after`` on) matches ``pattern``."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.log()[after:])
            if m is not None:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not in job {self.id}'s output:\n{self.log()}")
            time.sleep(0.5)

    def scancel(self, *args: str) -> None:
        subprocess.run(["scancel", *args, self.id], env=self.cluster.env, check=True, timeout=30)

    def processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process on this machine that belongs to this job."""
        return job_processes(self.id)

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> int:
        """Signal the training process of initial ``rank`` (not its srun task); its pid."""
        for pid, argv in self.processes():
            if (
                "train.py" in argv
                and "restartable.inprocess.srun_task" not in argv
                and "bash" not in argv
            ):
                env = _environ(pid)
                if env.get("RANK") == str(rank) and "INPROCESS_LAUNCHER_PID" not in env:
                    os.kill(pid, sig)
                    return pid
        raise AssertionError(f"no process of rank {rank} in job {self.id}: {self.processes()}")

    def kill_launcher(self, node: int) -> int:
        """SIGKILL ``inprocess.launch`` of ``node`` (its ranks die with it: a lost node)."""
        for pid, argv in self.processes():
            launcher = argv.split()[1:3] == ["-m", "restartable.launch"]
            if launcher and _environ(pid).get("SLURM_NODEID") == str(node):
                os.kill(pid, signal.SIGKILL)
                return pid
        raise AssertionError(f"no launcher of node {node} in job {self.id}: {self.processes()}")

    def assert_nothing_left(self, timeout: float = 20.0) -> None:
        """No process of the job may outlive it (store server, watchdogs, ranks)."""
        deadline = time.monotonic() + timeout
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not self.processes(), f"processes of job {self.id} outlived it: {self.processes()}"


def submit(
    cluster: SlurmCluster,
    script: str,
    out_dir: Path,
    *,
    env: dict[str, str],
    sbatch: tuple[str, ...] = (),
) -> Job:
    """``sbatch`` ``examples/slurm/<script>`` from the repository root with ``env`` exported."""
    out_dir.mkdir(parents=True, exist_ok=True)  # sbatch cannot make it: the job would FAIL
    output = out_dir / f"{script}.out"
    full = {**cluster.env, "PYTHONPATH": str(REPO), **env}
    r = subprocess.run(
        ["sbatch", "--parsable", f"--output={output}", f"--chdir={REPO}", *sbatch,
         str(REPO / "examples" / "slurm" / script)],
        env=full, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return Job(r.stdout.strip().split(";")[0], output, cluster)


def final_loss(log: str) -> str:
    found = re.findall(r"final step \d+ \(steps completed\), final loss (\S+)", log)
    assert found, log[-3000:]
    return found[-1]


def job_processes(job_id: str) -> list[tuple[int, str]]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        env = _environ(int(d.name))
        if env.get("SLURM_JOB_ID") == job_id and "slurmstepd" not in _cmdline(int(d.name)):
            out.append((int(d.name), _cmdline(int(d.name))))
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")
