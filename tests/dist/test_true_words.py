"""Issue 47, "true words": what a user reads about a run says what happened."""

from __future__ import annotations

from tests.multiproc import run_job

SCRIPT = "tests/dist/workers_words.py"


def _launch(*args: str) -> list[str]:
    return ["-m", "inprocess.launch", "--nproc-per-node", "3", SCRIPT, *args]


def test_an_error_of_the_ranks_own_code_inside_torch_distributed_is_its_error_with_traceback() -> (
    None
):
    # Found by a user: an operator DTensor cannot shard, hit on every rank, was logged as
    # "rank N: a collective failed" (a WARNING meant for a peer's fault) and the user's own
    # frame was never printed.
    job = run_job(_launch("dtensor"), deadline=150)
    assert job.returncode == 0, job.output
    assert "a collective failed" not in job.output, job.output
    # One traceback (the user's frame once) even when both ranks raised it before the restart
    # (tests/unit/test_raised.py: the other rank's one line).
    assert job.output.count(", in user_code") == 1, job.output
    assert "Sharding propagation failed" in job.output, job.output
    assert "iteration 1 rank 0: done" in job.output, job.output
