"""Issue 47: a plain value that differs between ranks is named after the first persistent save
(at the next save, never waiting on a peer), with ``PerRank`` (the persistent tier keeps one
copy: every rank would restore the same)."""

from __future__ import annotations

from pathlib import Path

from tests.multiproc import run_ranks

TARGET = "tests.dist.workers_rank_values:save_twice"


def test_a_per_rank_value_outside_per_rank_is_named_once_on_rank_0(tmp_path: Path) -> None:
    # Found by a user: torch.get_rng_state() in the state without PerRank came back identical
    # on every rank from the persistent tier, and nothing said so.
    outs = run_ranks(2, target=TARGET, kwargs={"root": str(tmp_path), "per_rank": False})
    assert outs[1].result["warnings"] == [], outs[1].output
    (warning,) = outs[0].result["warnings"]
    assert warning.startswith("checkpoint: state['rng'] differs between ranks but it is not "), (
        warning
    )
    assert "PerRank(rng=torch.get_rng_state())" in warning
    assert "lr" not in warning and "model" not in warning


def test_the_same_value_under_per_rank_is_not_named(tmp_path: Path) -> None:
    outs = run_ranks(2, target=TARGET, kwargs={"root": str(tmp_path), "per_rank": True})
    assert [o.result["warnings"] for o in outs] == [[], []]
