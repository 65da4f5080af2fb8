"""Issue 47, "warm means warm": a reserve that takes a killed rank's place does not pay the
first DDP's imports (``torch._dynamo``, seconds) between the fault and its first step."""

from __future__ import annotations

import re
from pathlib import Path

from tests.multiproc import run_job

SCRIPT = "tests/dist/workers_warm.py"
_LINE = re.compile(
    r"iteration (\d) initial rank (\d): torch._dynamo imported before DDP: (True|False); "
    r"DDP\(\) took ([\d.]+) s"
)


def test_a_reserve_has_imported_what_ddp_needs_before_it_takes_a_killed_ranks_place(
    tmp_path: Path,
) -> None:
    marker = str(tmp_path / "warm")
    args = ["--nproc-per-node", "3", SCRIPT, "--train-s", "4", "--warm-marker", marker]
    job = run_job(["-m", "restartable.launch", *args], deadline=150)
    assert job.returncode == 0, job.output
    seen = {
        (int(it), int(r)): (warm == "True", float(s))
        for it, r, warm, s in _LINE.findall(job.output)
    }
    # The script alone does not import it: the active ranks' first DDP() does (and pays it).
    assert seen[(0, 0)][0] is False and seen[(0, 1)][0] is False, job.output
    # The reserve (initial rank 2) imported it while it waited: its DDP() after the kill is
    # the cheap second one (0.01 s measured; the first costs 1.1-5.9 s on this VM).
    assert (1, 2) in seen, job.output
    warm, ddp_s = seen[(1, 2)]
    assert warm is True, job.output
    assert ddp_s < 0.5, job.output
    assert "restart 1: dead on rank 0" in job.output, job.output
