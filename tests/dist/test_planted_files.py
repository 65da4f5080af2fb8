"""What another user plants on disk, against live launched jobs (issue 46, findings 1 and 5).

* A crafted ``.metadata`` in the newest persistent checkpoint, with ``_COMMITTED.json`` fixed
  up to match, is met by the next launch: no code runs, the job resumes from the checkpoint
  before it and trains to its end.
* A journal directory owned by a real second user, who planted links to a file of ours at the
  journal's names, stops the launch before any rank starts, with one line naming it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import zlib
from pathlib import Path

from tests.multiproc import JobOutput, free_port, run_job, slow
from tests.payload import Payload
from tests.stranger import as_stranger, stranger_dir

_DEADLINE_S = 240.0  # generous: a loaded 2-core machine takes a minute to start 2 ranks


def _launch(job: Path, journal: Path) -> JobOutput:
    return run_job(
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
        env={"RESTARTABLE_JOURNAL_DIR": str(journal)},
    )


def _craft_newest(root: Path, marker: Path) -> Path:
    """Replace the newest checkpoint's ``.metadata`` by DCP's own metadata with a payload riding
    in it, and fix up ``_COMMITTED.json`` to match (what anyone who can write it can do)."""
    newest = sorted(root.glob("step_*"))[-1]
    metadata = pickle.loads((newest / ".metadata").read_bytes())
    metadata.planner_data = {"x": Payload(marker)}
    crafted = pickle.dumps(metadata)
    (newest / ".metadata").write_bytes(crafted)
    commit = newest / "_COMMITTED.json"
    body = json.loads(commit.read_text())
    body["files"][".metadata"] = {"crc32": zlib.crc32(crafted), "size": len(crafted)}
    commit.write_text(json.dumps(body))
    return newest


@slow(
    "two launches (81 s on the loaded 2-core machine); the refusal and the fallback run by "
    "default in tests/unit/test_crafted_checkpoint.py"
)
def test_a_crafted_metadata_runs_no_code_in_the_next_launch(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    first = _launch(job, tmp_path / "journal")
    assert first.returncode == 0, first.output
    marker = tmp_path / "pwned"
    newest = _craft_newest(job / "persistent", marker)
    shutil.rmtree(job / "local")  # the nodes were replaced: only the persistent tier is left
    second = _launch(job, tmp_path / "journal")
    output = second.output
    assert second.returncode == 0, output
    assert not marker.exists(), output  # no code ran from the crafted file
    assert f"{newest / '.metadata'}: not a DCP metadata file of plain data" in output, output
    assert "falling back to the previous committed checkpoint" in output, output


def test_a_journal_dir_of_another_user_stops_the_launch_with_one_line(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"ours\n")
    victim.chmod(0o600)
    theirs = stranger_dir("journal-")
    try:
        host = socket.gethostname()
        for name in [f"rank-1-{host}-{os.getpid() + i}.jsonl" for i in range(1, 40)]:
            as_stranger("ln", "-s", str(victim), str(theirs / name))
        job = tmp_path / "job"
        job.mkdir(mode=0o700)
        run = _launch(job, theirs)
        output = run.output
        assert run.returncode == 1, output
        assert "Traceback" not in output, output
        (line,) = [ln for ln in output.splitlines() if "RESTARTABLE_JOURNAL_DIR" in ln]
        assert f"('{theirs}') belongs to uid" in line, output
        assert victim.read_bytes() == b"ours\n"
        assert list(job.iterdir()) == []  # no rank started
    finally:
        shutil.rmtree(theirs)
