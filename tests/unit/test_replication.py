"""The local tier's pure replica placement and restore planning."""

from __future__ import annotations

from checkpoint import replication as r


def test_replicas_go_to_other_nodes_and_invert() -> None:
    world, lws = 6, 2
    for owner in range(world):
        hs = r.holders(owner, world, lws, factor=3)
        assert len(hs) == 2
        nodes = {owner // lws} | {h // lws for h in hs}
        assert len(nodes) == 3  # one copy per node
        for h in hs:
            assert owner in r.owners_held_by(h, world, lws, factor=3)


def test_factor_is_capped_by_node_count() -> None:
    assert r.effective_factor(4, 4, 2) == 1
    assert r.holders(0, 4, 4, 2) == []
    assert r.holders(1, 4, 2, 5) == [3]


def test_plan_prefers_own_copy_then_spreads_over_holders() -> None:
    inv = [[(5, 0), (5, 1), (5, 2)], [], [(5, 2)]]
    plan = r.plan_restore(3, inv, min_step=None)
    assert plan == r.RestorePlan(5, (0, 0, 2))


def test_plan_picks_newest_step_every_rank_can_get() -> None:
    inv = [[(4, 0), (5, 0), (4, 1)], [(5, 1)], [(4, 2)]]  # step 5 lacks owner 2
    assert r.plan_restore(3, inv, min_step=None) == r.RestorePlan(4, (0, 0, 2))
    assert r.plan_restore(3, inv, min_step=5) is None


def test_plan_skips_bad_copies() -> None:
    inv = [[(2, 0), (1, 0)], [(2, 0), (2, 1), (1, 0), (1, 1)]]
    assert r.plan_restore(2, inv, min_step=None) == r.RestorePlan(2, (0, 1))
    plan = r.plan_restore(2, inv, min_step=None, bad=[(2, 0, 0)])
    assert plan == r.RestorePlan(2, (1, 1))
    plan = r.plan_restore(2, inv, min_step=None, bad=[(2, 0, 0), (2, 0, 1)])
    assert plan == r.RestorePlan(1, (0, 1))


def test_no_copies_no_plan() -> None:
    assert r.plan_restore(2, [[], []], min_step=None) is None


def test_assign_replicated_balances_bytes_deterministically() -> None:
    sizes = [("a", 100), ("b", 60), ("c", 50), ("d", 10)]
    got = r.assign_replicated(sizes, 2)
    assert got == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert got == r.assign_replicated(list(reversed(sizes)), 2)
