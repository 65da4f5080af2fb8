"""A stranger on the store's port, against a live job (docs/security.md).

The probe connects to the job's TCPStore like anyone on the network could, lists every key and
overwrites them: with crafted pickles that would create a file if anything unpickled them, and
with forged control values (the launcher's "end with status 0", a done outcome, a journal
directory and a checkpoint directory of the probe's choosing). Whatever it writes, no code runs,
no file appears outside the job's directories, and the job never exits 0 without finishing.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.multiproc import REPO_ROOT, free_port, slow, wait_for_output
from tests.payload import Payload

# 0.2 s each: the job is still training when the probe has written for 3 s (it starts at step
# 3), and a job that never meets a forged key trains to its end in ~12 s.
STEPS = 60
_DEADLINE_S = 240.0  # generous: a loaded 2-core machine takes a minute to start 2 ranks


def _launch(tmp: Path, port: int) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp / "job.log"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "PYTHONUNBUFFERED": "1",
        "RESTARTABLE_JOURNAL_DIR": str(tmp / "job" / "journal"),
    }
    env.pop("RESTARTABLE_SECRET", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "restartable.launch",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(port),
                "--max-restarts",
                "0",
                "--max-respawns",
                "0",
                "tests/dist/workers_probe.py",
                str(tmp / "job"),
                str(STEPS),
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, log


def _finish(proc: subprocess.Popen[bytes], log: Path) -> int:
    try:
        return proc.wait(timeout=_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the probed job did not end within {_DEADLINE_S} s:\n{log.read_text()}")


def _files_outside(tmp: Path) -> list[str]:
    return sorted(str(p) for p in tmp.iterdir() if p.name not in ("job", "job.log"))


@pytest.mark.parametrize(
    "attack",
    [
        "pickles",
        pytest.param(
            "control",
            marks=slow("a forged launcher action is also rejected in tests/unit/test_sealing.py"),
        ),
    ],
)
def test_a_stranger_on_the_store_runs_no_code_and_never_ends_the_job_with_success(
    tmp_path: Path, attack: str
) -> None:
    port = free_port()
    proc, log = _launch(tmp_path, port)
    try:
        wait_for_output(log, "[rank 1] step 3", proc, deadline=_DEADLINE_S)
        probe = dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=10),
        )
        # The store listens on the address it was given (127.0.0.1), not on every interface.
        listening = [
            ln.split()[3]
            for ln in subprocess.run(
                ["ss", "-ltnH"], capture_output=True, text=True, check=False
            ).stdout.splitlines()
            if ln.split()[3].endswith(f":{port}")
        ]
        assert listening in ([], [f"127.0.0.1:{port}"]), listening  # [] where ss is missing
        listed = probe.list_keys()
        assert any(k.startswith("restartable/") for k in listed), listed  # a stranger sees them
        crafted = pickle.dumps(Payload(tmp_path / "pwned"))
        end = time.monotonic() + 3.0
        written = 0
        while time.monotonic() < end and proc.poll() is None:
            try:
                keys = probe.list_keys()
            except dist.DistNetworkError:
                # The job stopped on what the probe wrote: its launcher closed the store, and
                # exits only after that (its process may still run at the poll above).
                assert written > 0, log.read_text(errors="replace")
                break
            for key in keys:
                if attack == "pickles":
                    probe.set(key, crafted)
                elif key.endswith("/start") or key.endswith("/global/0"):
                    # What a save's ranks read next: a directory of the probe's choosing.
                    probe.set(key, pickle.dumps((str(tmp_path / "evil-ckpt"), None)))
                written += 1
            if attack == "control":
                probe.set(
                    "launch/r0/action", json.dumps({"kind": "end", "status": 0, "reason": "forged"})
                )
                probe.set("restartable/journal_dir", str(tmp_path / "evil-journal"))
                for it in range(3):
                    probe.set(f"restartable/it{it}/end", "done")
            time.sleep(0.1)
        assert written > 0
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    rc = _finish(proc, log)
    output = log.read_text(errors="replace")
    assert not (tmp_path / "pwned").exists(), output  # no code ran from the store
    assert _files_outside(tmp_path) == [], output  # nothing written where the probe said
    finished = list((tmp_path / "job").glob("finished-*"))
    # Never a success status unless training finished. Whether the ranks meet a forged key
    # before their last step depends on timing (at full speed they may train to the end first);
    # either way the launcher must not report success on a store it could not trust.
    assert rc != 0, f"exit {rc}, finished {finished}:\n{output}"
    assert "rejected unread" in output, output  # the forged values were named, not parsed
