"""Rank assignment: examples a user would recognise, plus hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from restartable.inprocess.protocol.ranks import (
    Assignment,
    NotEnoughRanksError,
    initial_assignment,
    node_index,
    node_of_ranks,
    reassign,
    respawn_identity,
)

NODES_3X2 = node_of_ranks(world_size=6, local_world_size=2)  # (0, 0, 1, 1, 2, 2)


def start(world: int, active: int | None, node_of: tuple[int, ...] | None = None) -> Assignment:
    return initial_assignment(
        world_size=world,
        node_of=node_of or tuple(range(world)),
        active_world_size=active,
        granularity="rank",
    )


def test_initial_assignment_first_k_active_rest_reserve_in_order() -> None:
    a = start(5, 3)
    assert a.active == (0, 1, 2)
    assert a.reserve == (3, 4)
    assert a.retired == frozenset()
    assert [a.rank_of(r) for r in range(5)] == [0, 1, 2, None, None]
    assert a.world_size == 3


def test_initial_assignment_none_means_all_active() -> None:
    assert start(4, None).active == (0, 1, 2, 3)


def test_lost_rank_replaced_by_first_reserve_at_same_rank_number() -> None:
    a = start(4, 3)
    b = reassign(
        a,
        node_of=range(4),
        lost=[1],
        granularity="rank",
        active_world_size=3,
        min_active_world_size=3,
    )
    assert b.active == (0, 3, 2)  # the reserve runs as rank 1, the others keep their rank
    assert b.reserve == ()
    assert b.retired == {1}
    assert b.rank_of(3) == 1
    assert b.rank_of(1) is None


def test_rank_zero_lost_is_like_any_other() -> None:
    b = reassign(
        start(3, 2),
        node_of=(0, 1, 2),
        lost=[0],
        granularity="rank",
        active_world_size=2,
        min_active_world_size=2,
    )
    assert b.active == (2, 1)
    assert b.rank_of(2) == 0


def test_rank_that_only_raised_stays_in_place() -> None:
    a = start(3, 2)
    b = reassign(
        a, node_of=(0, 1, 2), lost=[], granularity="rank", active_world_size=2,
        min_active_world_size=1,
    )  # fmt: skip
    assert b == a


def test_demoted_rank_goes_to_back_of_pool_and_is_replaced() -> None:
    b = reassign(
        start(4, 2),
        node_of=(0, 1, 2, 3),
        lost=[],
        demoted=[0],
        granularity="rank",
        active_world_size=2,
        min_active_world_size=2,
    )
    assert b.active == (2, 1)
    assert b.reserve == (3, 0)
    assert b.retired == frozenset()


def test_demoted_rank_reused_rather_than_shrinking() -> None:
    b = reassign(
        start(2, 2),
        node_of=(0, 1),
        lost=[],
        demoted=[1],
        granularity="rank",
        active_world_size=2,
        min_active_world_size=1,
    )
    assert b.active == (0, 1)


def test_shrink_when_reserves_exhausted_survivors_keep_low_numbers() -> None:
    b = reassign(
        start(4, 4),
        node_of=(0, 1, 2, 3),
        lost=[1],
        granularity="rank",
        active_world_size=4,
        min_active_world_size=2,
    )
    # The highest rank moves into the hole; ranks 0 and 2 keep their numbers.
    assert b.active == (0, 3, 2)


def test_not_enough_ranks_names_counts_and_fix() -> None:
    with pytest.raises(NotEnoughRanksError) as info:
        reassign(
            start(3, 2),
            node_of=(0, 1, 2),
            lost=[0, 2],
            granularity="rank",
            active_world_size=2,
            min_active_world_size=2,
        )
    msg = str(info.value)
    assert "only 1 healthy rank" in msg
    assert "min_active_world_size is 2" in msg
    assert "[0, 2]" in msg
    assert "lower min_active_world_size" in msg


def test_node_granularity_retires_whole_node_and_takes_whole_reserve_node() -> None:
    a = initial_assignment(world_size=6, node_of=NODES_3X2, active_world_size=4, granularity="node")
    b = reassign(
        a,
        node_of=NODES_3X2,
        lost=[1],
        granularity="node",
        active_world_size=4,
        min_active_world_size=4,
    )
    assert b.active == (4, 5, 2, 3)  # node 2 replaces node 0 in rank slots 0 and 1
    assert b.reserve == (0,)  # the healthy node-mate waits at the back; it does not exit
    assert b.retired == {1}


def test_node_granularity_prefers_whole_node_over_pool_front() -> None:
    node_of = node_of_ranks(world_size=8, local_world_size=2)
    a = initial_assignment(world_size=8, node_of=node_of, active_world_size=4, granularity="node")
    # Node 2 loses rank 5 while waiting; its healthy mate 4 goes back. Node 0 then faults.
    b = reassign(
        a, node_of=node_of, lost=[5], granularity="node", active_world_size=4,
        min_active_world_size=2,
    )  # fmt: skip
    assert b.active == (0, 1, 2, 3)
    assert b.reserve == (6, 7, 4)
    c = reassign(
        b, node_of=node_of, lost=[0], granularity="node", active_world_size=4,
        min_active_world_size=2,
    )  # fmt: skip
    assert c.active == (6, 7, 2, 3)
    assert c.reserve == (4, 1)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("active_world_size", {"world_size": 2, "node_of": (0, 0), "active_world_size": 3}),
        ("node_of", {"world_size": 2, "node_of": (0,), "active_world_size": None}),
        ("world_size", {"world_size": 0, "node_of": (), "active_world_size": None}),
    ],
)
def test_bad_initial_input_names_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=field):
        initial_assignment(granularity="rank", **kwargs)  # type: ignore[arg-type]


def test_bad_granularity_and_min_size_name_field() -> None:
    with pytest.raises(ValueError, match=r"granularity .'host'. must be one of"):
        start(2, None) and initial_assignment(
            world_size=2, node_of=(0, 0), active_world_size=None, granularity="host"
        )
    with pytest.raises(ValueError, match=r"min_active_world_size \(3\)"):
        reassign(
            start(2, None), node_of=(0, 1), lost=[], granularity="rank", active_world_size=2,
            min_active_world_size=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"lost \(\[7\]\)"):
        reassign(
            start(2, None), node_of=(0, 1), lost=[7], granularity="rank", active_world_size=2,
            min_active_world_size=1,
        )  # fmt: skip


# --- properties ------------------------------------------------------------------------------


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[tuple[int, ...], str, int, int, list[tuple[set[int], set[int]]]]:
    per_node = draw(st.integers(1, 3))
    nodes = draw(st.integers(1, 5))
    world = per_node * nodes
    node_of = node_of_ranks(world_size=world, local_world_size=per_node)
    granularity = draw(st.sampled_from(["rank", "node"]))
    k = draw(st.integers(1, world))
    min_k = draw(st.integers(1, k))
    ranks = st.sets(st.integers(0, world - 1), max_size=2)
    faults = draw(st.lists(st.tuples(ranks, ranks), max_size=5))
    return node_of, granularity, k, min_k, faults


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_properties_hold_over_fault_sequences(
    scenario: tuple[tuple[int, ...], str, int, int, list[tuple[set[int], set[int]]]],
) -> None:
    node_of, granularity, k, min_k, faults = scenario
    world = len(node_of)
    node_size = {n: node_of.count(n) for n in set(node_of)}
    a = initial_assignment(
        world_size=world, node_of=node_of, active_world_size=k, granularity=granularity
    )
    ever_lost: set[int] = set()
    for lost, demoted in faults:
        try:
            b = reassign(
                a,
                node_of=node_of,
                lost=lost,
                demoted=demoted,
                granularity=granularity,
                active_world_size=k,
                min_active_world_size=min_k,
            )
        except NotEnoughRanksError:
            healthy = world - len(a.retired | lost)
            assert healthy < min_k  # raised only when there really are too few ranks
            return
        ever_lost |= lost
        # Every healthy rank is active or reserve exactly once; every rank has one role.
        assert len(set(b.active)) == len(b.active)
        assert len(set(b.reserve)) == len(b.reserve)
        assert set(b.active).isdisjoint(b.reserve)
        assert set(b.active) | set(b.reserve) | b.retired == set(range(world))
        assert (set(b.active) | set(b.reserve)).isdisjoint(b.retired)
        # Lost ranks never come back.
        assert ever_lost <= b.retired
        # Active ranks are 0..n-1 with min_k <= n <= k; shrink only when ranks ran out.
        assert min_k <= b.world_size <= k
        if b.world_size < k:
            assert b.reserve == ()
        assert [b.rank_of(r) for r in b.active] == list(range(b.world_size))
        # Survivors that raised nothing keep their rank number when no shrink happened.
        if b.world_size == k and granularity == "rank":
            for i, r in enumerate(a.active):
                if r not in lost and r not in demoted and i < k:
                    assert b.active[i] == r
        if granularity == "node" and b.reserve:
            # A node is never split between the active set and a waiting whole node's place:
            # while a complete healthy node waits, no rank of a node that just faulted runs.
            faulty_nodes = {node_of[r] for r in (lost - a.retired) | demoted}
            waiting_whole = [
                n
                for n in node_size
                if n not in faulty_nodes and sum(node_of[r] == n for r in b.reserve) == node_size[n]
            ]
            if waiting_whole:
                assert not any(node_of[r] in faulty_nodes for r in b.active)
        a = b


# ----- respawned identities (issue 14) -------------------------------------------------------


def test_respawned_identity_names_a_new_slot_on_the_same_node() -> None:
    assert respawn_identity(1, 0, world_size=4) == 1
    assert respawn_identity(1, 2, world_size=4) == 9
    assert node_index(9, NODES_3X2) == NODES_3X2[3]  # identity 9 = slot 3 of a 6-rank job
    with pytest.raises(ValueError, match="slot"):
        respawn_identity(4, 1, world_size=4)


def test_joined_process_waits_at_the_back_of_the_pool_then_fills_the_next_hole() -> None:
    a = start(4, 3)
    b = reassign(a, node_of=range(4), lost=[1], granularity="rank",
                 active_world_size=3, min_active_world_size=3)  # fmt: skip
    assert (b.active, b.reserve) == ((0, 3, 2), ())
    # The slot of rank 1 was respawned as identity 5: the next loss is covered by it.
    c = reassign(b, node_of=range(4), lost=[3], joined=[5], granularity="rank",
                 active_world_size=3, min_active_world_size=3)  # fmt: skip
    assert (c.active, c.reserve, c.retired) == ((0, 5, 2), (), {1, 3})
    # A fault with nothing lost admits a joined process as a reserve, once.
    d = reassign(c, node_of=range(4), lost=[], joined=[5, 7], granularity="rank",
                 active_world_size=3, min_active_world_size=3)  # fmt: skip
    assert (d.active, d.reserve) == ((0, 5, 2), (7,))


def test_joined_identities_must_be_respawned_ones_and_lost_ranks_must_be_in_the_job() -> None:
    a = start(4, 3)
    with pytest.raises(ValueError, match="joined"):
        reassign(a, node_of=range(4), lost=[], joined=[2], granularity="rank",
                 active_world_size=3, min_active_world_size=1)  # fmt: skip
    with pytest.raises(ValueError, match="lost"):
        reassign(a, node_of=range(4), lost=[9], granularity="rank",
                 active_world_size=3, min_active_world_size=1)  # fmt: skip


def test_node_with_its_lost_rank_respawned_is_whole_again() -> None:
    # Nodes {0,1} {2,3} {4,5}; 2 active (node 0); rank 1 is lost and its node steps back.
    a = initial_assignment(world_size=6, node_of=NODES_3X2, active_world_size=2,
                           granularity="node")  # fmt: skip
    b = reassign(a, node_of=NODES_3X2, lost=[1], granularity="node",
                 active_world_size=2, min_active_world_size=2)  # fmt: skip
    assert b.active == (2, 3)
    # Identity 7 (slot 1, generation 1) lives on node 0 with rank 0: node 0 is whole again.
    c = reassign(b, node_of=NODES_3X2, lost=[3], joined=[7], granularity="node",
                 active_world_size=2, min_active_world_size=2)  # fmt: skip
    assert (c.active, c.reserve) == ((4, 5), (0, 7, 2))
    d = reassign(c, node_of=NODES_3X2, lost=[5], granularity="node",
                 active_world_size=2, min_active_world_size=2)  # fmt: skip
    assert d.active == (0, 7)  # taken whole, before the survivors of faulty nodes 1 and 2
