"""A real two-node Slurm cluster on this machine, for tests/slurm/ (and for trying the scripts).

    python tests/slurm_cluster.py install       # apt-get the packages when missing (root)
    python tests/slurm_cluster.py up [--proctrack pgid]   # start it, print its SLURM_CONF, wait
    python -m pytest tests/slurm                # the tests start their own (fixture)

Debian's slurm-wlm (22.05): one munged, one slurmctld and two ``slurmd -N nX`` on loopback
addresses 127.0.0.11 and .12 (``/etc/hosts`` names them n1 and n2, as a real cluster's DNS
would), all configured in a scratch directory (``SLURM_CONF`` points there; munged listens on a
private socket), so nothing in /etc/slurm or /run/munge is touched. ``SlurmCluster`` starts the
daemons in that order (a slurmd that starts before munged loops on "Munge encode failed" and
ignores SIGTERM for a minute), waits until ``sinfo`` shows every node idle, and ``close()``
cancels what still runs, stops each daemon by its pid (SIGTERM, then SIGKILL) and removes the
directory and the nodes' freezer cgroups. One cluster at a time per machine (node names, cgroups
and /etc/hosts are shared): the lock file serialises concurrent test sessions.

The config is the reference for admins in docs/launching.md#slurm: proctrack (any of cgroup,
pgid, linuxproc), ``JobRequeue=1``, and the two settings that make a requeue take ~10 s instead
of ~2.5 min on an idle test cluster (``AuthInfo=cred_expire=10``, ``sched_interval=5``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

if __package__:
    from tests.multiproc import free_ports
else:  # run as a script (python tests/slurm_cluster.py): tests/ is on sys.path
    from multiproc import free_ports

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch", "/usr/sbin/munged")
PROCTRACK = ("cgroup", "pgid", "linuxproc")
NODES = {"n1": "127.0.0.11", "n2": "127.0.0.12"}
# nodes=3 (SlurmCluster, `up --nodes 3`): an etcd member per node survives the loss of one
NODES_3 = {**NODES, "n3": "127.0.0.13"}
CPUS_PER_NODE = 4  # declared (config_overrides): more tasks than this machine's cores, on purpose
LOCK = Path(tempfile.gettempdir()) / "restartable-slurm.lock"
_START_TIMEOUT_S = 60.0
_STOP_GRACE_S = 10.0

SLURM_CONF = """\
ClusterName=restartable
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=10: a requeued job may start again 10 s after its end (default 120 s)
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/{proctrack}
TaskPlugin=task/affinity
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# sched_interval=5: the requeued job is looked at within 5 s (default 60 s)
SchedulerParameters=sched_interval=5,bf_interval=5
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
JobRequeue=1
ReturnToService=2
# SIGTERM -> SIGKILL at a job's end, scancel or time limit (default 30 s)
KillWait=10
MinJobAge=600
{nodes}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""

CGROUP_CONF = """\
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
"""


def skip_reason() -> str | None:
    """Why a Slurm cluster cannot be started here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "Slurm tests need Linux"
    missing = [b for b in BINARIES if not os.access(b, os.X_OK)]
    if missing:
        return (
            f"{', '.join(missing)} not found: run `python tests/slurm_cluster.py install` as "
            f"root on Debian (apt-get install {' '.join(PACKAGES)})"
        )
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (slurmd starts jobs and owns cgroups)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "user munge is missing: reinstall the munge package"
    if not Path("/etc/munge/munge.key").exists():
        return "/etc/munge/munge.key is missing: reinstall the munge package"
    return None


def install() -> str | None:
    """apt-get the packages when a binary is missing and this is a root Debian host; returns why
    not (None: installed or already there)."""
    if all(os.access(b, os.X_OK) for b in BINARIES):
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "Slurm missing (needs root and apt-get): the Slurm tests will skip"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    # The postinst scripts make the munge key; their service starts are refused without systemd
    # (harmless: SlurmCluster starts the daemons itself).
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
        check=True,
        env=env,
    )
    return None


class SlurmCluster:
    """munged + slurmctld + one slurmd per node, configured under a scratch directory.

    Construct it (blocks until every node is idle, at most ``_START_TIMEOUT_S``; raises
    ``RuntimeError`` with the daemons' logs otherwise), use ``env`` for sbatch / squeue /
    scontrol, ``close()`` it (idempotent; also on ``__exit__``). Holds ``LOCK`` meanwhile
    (``lock_timeout`` seconds to get it; ``TimeoutError`` after that).
    """

    def __init__(
        self, *, proctrack: str = "cgroup", lock_timeout: float = 600.0, nodes: int = 2
    ) -> None:
        if proctrack not in PROCTRACK:
            raise ValueError(f"proctrack ({proctrack!r}) must be one of {PROCTRACK}")
        if nodes not in (2, 3):
            raise ValueError(f"nodes ({nodes}) must be 2 or 3")
        self.nodes = NODES if nodes == 2 else NODES_3
        self.proctrack = proctrack
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.closed = False
        self._lock: IO[str] | None = _take_lock(lock_timeout)
        self.dir = Path(tempfile.mkdtemp(prefix="slurm-test-"))
        try:
            self._configure()
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """This process's environment pointed at the cluster (sbatch exports it to the job)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _configure(self) -> None:
        d = self.dir
        d.chmod(0o755)
        munge = d / "munge"
        munge.mkdir()
        user = pwd.getpwnam("munge")
        os.chown(munge, user.pw_uid, user.pw_gid)
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        self.munge_socket = munge / "munge.socket.2"
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        nodes = "\n".join(
            f"NodeName={name} NodeHostname=localhost NodeAddr={addr} Port={port} "
            f"CPUs={CPUS_PER_NODE} State=UNKNOWN"
            for (name, addr), port in zip(self.nodes.items(), node_ports, strict=True)
        )
        self.conf.write_text(
            SLURM_CONF.format(
                ctld_port=ctld_port,
                munge_socket=self.munge_socket,
                dir=d,
                proctrack=self.proctrack,
                nodes=nodes,
                node_names=",".join(self.nodes),
            )
        )
        (d / "cgroup.conf").write_text(CGROUP_CONF)
        _ensure_hosts(self.nodes)

    def _spawn(self, name: str, argv: list[str], *, user: str | None = None) -> None:
        with open(self.dir / f"{name}.out", "ab") as out:
            self.procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                user=user,
                start_new_session=True,
            )

    def _start(self) -> None:
        m = self.dir / "munge"
        self._spawn(
            "munged",
            [
                "/usr/sbin/munged",
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--pid-file={m / 'munged.pid'}",
                f"--log-file={m / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
            user="munge",
        )
        self._wait(lambda: self.munge_socket.exists(), "munged to open its socket")
        self._spawn("slurmctld", ["/usr/sbin/slurmctld", "-D", "-f", str(self.conf)])
        self._wait(lambda: self._quiet(["scontrol", "ping"]), "slurmctld to answer")
        for name in self.nodes:
            self._spawn(
                f"slurmd-{name}", ["/usr/sbin/slurmd", "-D", "-N", name, "-f", str(self.conf)]
            )
        self._wait(lambda: self.idle_nodes() == len(self.nodes), "every node to be idle")

    def _quiet(self, argv: list[str]) -> bool:
        r = subprocess.run(argv, env=self.env, capture_output=True, timeout=30)
        return r.returncode == 0 and b"DOWN" not in r.stdout

    def _wait(self, ready: object, what: str) -> None:
        assert callable(ready)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{dead} exited" if dead else f"not within {_START_TIMEOUT_S:.0f} s"
                raise RuntimeError(f"Slurm test cluster: waiting for {what}: {why}\n{self.logs()}")
            time.sleep(0.1)

    def idle_nodes(self) -> int:
        r = subprocess.run(
            ["sinfo", "-h", "-o", "%D", "-t", "idle"], env=self.env, capture_output=True, text=True
        )
        return sum(int(x) for x in r.stdout.split() if x.isdigit())

    def logs(self, tail: int = 3000) -> str:
        """The tail of every daemon's log (for failure messages)."""
        out = []
        for path in sorted([*self.dir.glob("*.log"), *self.dir.glob("*.out")]):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def close(self) -> None:
        """Cancel every job, stop every daemon by pid, remove the directory (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
                subprocess.run(["scancel", "--full", "--user=root"], env=self.env, timeout=30,
                               capture_output=True)  # fmt: skip
                self._drain_jobs()
            # Reverse start order: the nodes first, munged last (they all need it to the end).
            for name in reversed(list(self.procs)):
                _stop(self.procs[name])
            for name in self.nodes:
                with contextlib.suppress(OSError):
                    _remove_cgroup(Path("/sys/fs/cgroup/freezer") / f"slurm_{name}")
            shutil.rmtree(self.dir, ignore_errors=True)
        finally:
            if self._lock is not None:
                self._lock.close()  # releases the flock
                self._lock = None

    def _drain_jobs(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True,
                               text=True, timeout=30)  # fmt: skip
            if r.returncode != 0 or not r.stdout.strip():
                return
            time.sleep(0.5)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _take_lock(timeout: float) -> IO[str]:
    f = open(LOCK, "w")  # noqa: SIM115 - held until close()
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() > deadline:
                f.close()
                raise TimeoutError(
                    f"another Slurm test cluster holds {LOCK} for more than {timeout:.0f} s"
                ) from None
            time.sleep(1.0)


def _ensure_hosts(nodes: dict[str, str]) -> None:
    """Name the nodes in /etc/hosts (a real cluster's DNS does): scripts resolve
    ``scontrol show hostnames`` output."""
    hosts = Path("/etc/hosts")
    known = {tuple(line.split()[:2]) for line in hosts.read_text().splitlines() if line.strip()}
    missing = [f"{addr} {name}" for name, addr in nodes.items() if (addr, name) not in known]
    if missing:
        with open(hosts, "a") as f:
            f.write("".join(f"{line}\n" for line in missing))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(_STOP_GRACE_S)


def _remove_cgroup(path: Path) -> None:
    """rmdir a freezer cgroup tree, leaves first (the kernel refuses a non-empty one)."""
    if not path.is_dir():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        child.rmdir()
    path.rmdir()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="apt-get the packages when missing (root, Debian)")
    up = sub.add_parser("up", help="start a cluster, print SLURM_CONF, stop it on Ctrl-C")
    up.add_argument("--proctrack", choices=PROCTRACK, default="cgroup")
    up.add_argument("--nodes", type=int, choices=(2, 3), default=2)
    args = p.parse_args(argv)
    if args.cmd == "install":
        why = install()
        if why is not None:
            print(why, file=sys.stderr)
        return 0
    reason = skip_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 1
    t0 = time.monotonic()
    with SlurmCluster(proctrack=args.proctrack, nodes=args.nodes) as cluster:
        print(
            f"export SLURM_CONF={cluster.conf}  # up in {time.monotonic() - t0:.1f} s", flush=True
        )
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
