"""A process exits promptly whatever its background saves were doing (issue: the exit hang)."""

from __future__ import annotations

import threading
from pathlib import Path

from restartable.checkpoint import CheckpointManager
from tests.dist.workers_exit import PEER_WAIT_S, SAVE_TIMEOUT_S
from tests.multiproc import run_ranks, startup_s

SCRIPT = "tests/dist/workers_exit.py"


def test_exit_does_not_wait_for_a_save_its_peer_abandoned(tmp_path: Path) -> None:
    # Before the fix rank 1 sat in threading._shutdown for the save timeout (30 s here, 600 s
    # by default) waiting for a peer that had abandoned the save. What the test times is that
    # exit alone, from rank 1's return to its atexit hook; the deadline only ends a hang: the
    # ranks' start-up (2 on 2 cores: twice one's, measured now; 25 s fixed overran it at load
    # 5-11) and rank 0's wait for rank 1 by design.
    out = run_ranks(
        2,
        argv=[SCRIPT, "abandoned_by_peer", str(tmp_path)],
        deadline=2 * startup_s() + PEER_WAIT_S + 10,
        host_store=True,
    )
    assert out[0].result == {"rank1_exited": True}, out[0].output
    exit_s = (tmp_path / "rank1.exited").stat().st_mtime - out[1].result["returned_at"]
    assert exit_s < SAVE_TIMEOUT_S / 3, f"rank 1's exit took {exit_s:.1f} s\n{out[1].output}"
    assert "was not closed before interpreter exit" in out[1].output, out[1].output
    assert "a peer abandoned the save" in out[1].output, out[1].output
    assert not list(tmp_path.glob("step_*/.committed*")), "an abandoned save became visible"


def test_exit_completes_a_save_every_rank_can_finish(tmp_path: Path) -> None:
    out = run_ranks(
        2, argv=[SCRIPT, "completes_at_exit", str(tmp_path)], deadline=40, host_store=True
    )
    for rank in out:
        assert "the save of step 3 completed" in rank.output, rank.output
    with CheckpointManager(str(tmp_path), persistent_every=1) as mgr:
        assert mgr.latest_step() == 3


def test_checkpoint_threads_never_hold_the_exit(tmp_path: Path) -> None:
    # Daemon threads: the interpreter's exit waits only where close() decides to (bounded).
    with CheckpointManager(str(tmp_path), persistent_every=1, local_every=1):
        names = {t.name: t.daemon for t in threading.enumerate()}
        assert names.get("ckpt-persistent") is True and names.get("local-ckpt") is True, names
    left = [t.name for t in threading.enumerate() if t.name in ("ckpt-persistent", "local-ckpt")]
    assert not left, left
