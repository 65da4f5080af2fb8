"""The local tier's pure replica placement and restore planning."""

from __future__ import annotations

from restartable.checkpoint.local import placement as r


def _by_lws(world: int, lws: int) -> list[int]:
    return [r // lws for r in range(world)]


def test_replicas_go_to_other_nodes_and_invert() -> None:
    nodes = _by_lws(6, 2)
    plan = r.placement(nodes, factor=3)
    inverse = r.received_from(plan)
    for owner in range(6):
        assert len(plan[owner]) == 2
        assert len({nodes[owner]} | {nodes[h] for h in plan[owner]}) == 3  # one copy per node
        for h in plan[owner]:
            assert owner in inverse[h]
    assert plan[0] == [2, 4] and plan[3] == [5, 1]


def test_reassigned_ranks_still_replicate_off_node() -> None:
    # After a restart, a reserve from node 2 plays rank 1: ranks map to nodes 0, 2, 1, 1.
    nodes = r.node_indices(["h/0", "h/2", "h/1", "h/1"])
    assert nodes == [0, 1, 2, 2]
    plan = r.placement(nodes, factor=2)
    assert all(nodes[h] != nodes[o] for o, hs in enumerate(plan) for h in hs)
    assert all(len(hs) == 1 for hs in plan)


def test_factor_is_capped_by_node_count() -> None:
    assert r.effective_factor(_by_lws(4, 4), 2) == 1
    assert r.placement(_by_lws(4, 4), 2) == [[], [], [], []]
    assert r.placement(_by_lws(4, 2), 5)[1] == [3]


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
