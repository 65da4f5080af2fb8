"""Section timeouts with real ranks (CPU, gloo): learned limits catch a hang in a few step-times,
blame the hung rank, survive a relaunch through ft_state.json, and spare a slow first step."""

from __future__ import annotations

import json
from pathlib import Path

from tests.multiproc import run_ranks

W = "tests.dist.workers_sections"
SOFT_TIMEOUT = 2.0  # workers_sections.OPTIONS: without sections a hang costs at least this


def _blamed_on(rank: int, *, peer: int) -> list[list[str]]:
    """The restart causes that blame the hung ``rank``: the peer blocked in the all_reduce may
    also run past the limit before the decision; then it is listed as collateral, not counted."""
    cause = f"section_timeout (step) on rank {rank}"
    return [[cause], [f"{cause} (collateral, not counted: rank(s) {peer})"]]


def test_learned_step_timeout_catches_a_hang_and_a_relaunch_starts_from_ft_state_json(
    tmp_path: Path,
) -> None:
    """Two launches of one job (each one costs ~10 s of process start, so one test holds both).

    Launch 1 learns the step's timeout, a hang inside `step` is caught at it and blamed on the
    hung rank, and the slow first step after the restart is not a fault. Launch 2 hangs before
    it could learn on its own: only the value stored in ft_state.json can catch it in time.
    """
    state = tmp_path / "ft_state.json"
    outs = run_ranks(
        2,
        target=f"{W}:sectioned_job",
        kwargs={
            "state_path": str(state),
            "steps": 30,
            "hang_rank": 1,
            "hang_step": 22,
            "slow_first_step": 2.0,
        },
        host_store=True,
        deadline=60,
    )
    hung = outs[1].result
    for o in outs:
        step_limit, source = o.result["limits_at_hang"]["step"]
        assert source == "learned", o.result
        # The first step after the restart ran past the learned limit: judged by it, it would
        # have been a fault.
        assert o.result["slept"][0] > step_limit, o.result
        # One restart only: that slow first step of iteration 1 was warm-up, not a fault.
        assert o.result["seen"] == [0, 1], o.output
        assert o.result["blamed"] == [1], o.output  # not rank 0, blocked in all_reduce
        assert o.result["causes"] in _blamed_on(1, peer=0), o.output
        assert o.result["result"] == 60.0
    assert "section timeout: section 'step' ran" in outs[1].output
    # Caught at the learned limit (plus the restart), far below the soft timeout.
    assert hung["hang_interrupted_after"] < SOFT_TIMEOUT, hung
    saved = json.loads(state.read_text())["timeouts"]
    assert 0.0 < saved["step"] <= 30.0, saved
    learned = saved["step"]

    outs = run_ranks(
        2,
        target=f"{W}:sectioned_job",
        # 5 warm-up steps + 10 samples are needed to learn: at step 8 only the file can judge.
        kwargs={"state_path": str(state), "steps": 12, "hang_rank": 0, "hang_step": 8},
        host_store=True,
        deadline=60,
    )
    hung = outs[0].result
    assert hung["limits_at_hang"]["step"] == [learned, "stored"], hung
    assert "past its stored timeout" in outs[0].output
    for o in outs:
        assert o.result["seen"] == [0, 1], o.output
        assert o.result["causes"] in _blamed_on(0, peer=1), o.output
    assert hung["hang_interrupted_after"] < SOFT_TIMEOUT, hung
