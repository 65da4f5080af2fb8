"""Every file a real job writes is private to its user (docs/security.md, issue 46).

A launched 2-rank job with both checkpoint tiers, a journal, the watchdogs' logs, a fired fault
and one in-process restart runs under umask 022, so a file created with the default mode would
show as 0644; every file under its directories must be 0600 and every directory 0700.
"""

from __future__ import annotations

import stat
from pathlib import Path

from tests.multiproc import free_port, run_job

_DEADLINE_S = 240.0  # generous: a loaded 2-core machine takes a minute to start 2 ranks


def _modes(root: Path) -> dict[str, int]:
    """Every path under ``root`` (root itself excluded) -> its permission bits."""
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in sorted(root.rglob("*"))
    }


def test_every_file_a_job_writes_is_0600(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    job_run = run_job(
        [
            "-m",
            "restartable.launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "--max-restarts",
            "0",
            "--max-respawns",
            "0",
            "tests/dist/workers_private.py",
            str(job),
        ],
        deadline=_DEADLINE_S,
        env={"RESTARTABLE_JOURNAL_DIR": str(job / "journal")},
        umask=0o022,
    )
    output = job_run.output
    assert job_run.returncode == 0, output
    modes = _modes(job)
    kinds = {name.split("/")[0] for name in modes}
    # what the job wrote: both tiers, the journal, the watchdogs' logs, the fault's record
    assert {"persistent", "local", "journal", "watchdog", "fired", "fired.jsonl"} <= kinds, modes
    assert any(n.endswith(".distcp") for n in modes) and any(
        n.endswith(".metadata") for n in modes
    ), modes
    files = {n: m for n, m in modes.items() if (job / n).is_file()}
    dirs = {n: m for n, m in modes.items() if (job / n).is_dir()}
    assert len(files) + len(dirs) == len(modes), "only plain files and directories, no links"
    assert {n: oct(m) for n, m in files.items() if m != 0o600} == {}, output
    assert {n: oct(m) for n, m in dirs.items() if m != 0o700} == {}, output
