"""Local checkpoint tier on real gloo ranks: memory, node-local directories, peer replicas."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests import peak_memory
from tests.multiproc import describe, run_ranks, slow

W = "tests.dist.workers_local"


def test_in_process_restart_restores_from_memory_and_algos_agree(tmp_path: Path) -> None:
    outs = run_ranks(
        4,
        target=f"{W}:memory_after_restart",
        kwargs={"base": str(tmp_path)},
        local_world_size=2,
        host_store=True,
        deadline=60,
    )
    for o in outs:
        r = o.result
        for algo in ("atomic", "fully_parallel"):
            assert r[algo] == {"step": 3, "tier": "memory", "ok": True}, (o.rank, r)
        assert r["identical"], o.rank
        # fully_parallel keeps ~1/4 of the replicated model on each rank (plus its own parts).
        assert r["fully_parallel_held_bytes"] < 0.6 * r["atomic_held_bytes"], r


@pytest.mark.parametrize(
    "min_step",
    [
        pytest.param(None, id="into_buffer", marks=slow("into_state covers the same lost node")),
        pytest.param(1, id="into_state"),
    ],
)
def test_lost_node_every_shard_comes_back(tmp_path: Path, min_step: int | None) -> None:
    base = str(tmp_path)
    kwargs = {"base": base, "algo": "fully_parallel"}
    run_ranks(
        6,
        target=f"{W}:save_steps",
        kwargs={**kwargs, "steps": [1, 2, 3]},
        local_world_size=2,
        host_store=True,
        deadline=60,
    )
    # Node 1 (ranks 2 and 3) is lost with its disk; fresh processes replace every rank.
    import shutil

    shutil.rmtree(tmp_path / "node1")
    outs = run_ranks(
        6,
        target=f"{W}:restore_fresh",
        kwargs={**kwargs, "min_step": min_step},
        local_world_size=2,
        host_store=True,
        deadline=60,
    )
    tiers = {o.rank: o.result["tier"] for o in outs}
    assert all(o.result["step"] == 3 and o.result["ok"] for o in outs), [o.result for o in outs]
    assert tiers == {
        0: "local_dir",
        1: "local_dir",
        2: "peer",
        3: "peer",
        4: "local_dir",
        5: "local_dir",
    }


def test_corrupt_copy_is_never_loaded(tmp_path: Path) -> None:
    base = str(tmp_path)
    run_ranks(
        4,
        target=f"{W}:save_steps",
        kwargs={"base": base, "algo": "atomic", "steps": [1, 2]},
        local_world_size=2,
        host_store=True,
        deadline=60,
    )
    outs = run_ranks(
        4,
        target=f"{W}:restore_corrupt",
        kwargs={"base": base},
        local_world_size=2,
        host_store=True,
        deadline=60,
    )
    first, second, third = outs[0].result["results"]
    assert first == {"step": 2, "tier": "peer", "ok": True}  # own copy corrupt -> replica
    assert second == {"step": 1, "tier": "local_dir", "ok": True}  # both corrupt -> older step
    assert third is None  # nothing left -> the persistent tier's turn
    for o in outs[1:]:
        assert [r and r["step"] for r in o.result["results"]] == [2, 1, None], o.result


def test_corrupt_replica_received_in_place_is_overwritten(tmp_path: Path) -> None:
    outs = run_ranks(
        4,
        target=f"{W}:corrupt_replica_in_place",
        kwargs={"base": str(tmp_path)},
        local_world_size=2,
        host_store=True,
        deadline=60,
    )
    got = {o.rank: o.result for o in outs}
    for r, tier in {0: "memory", 1: "memory", 2: "peer", 3: "peer"}.items():
        assert got[r] == {"step": 1, "tier": tier, "ok": True}, (r, got[r])


@pytest.mark.skipif(not peak_memory.AVAILABLE, reason="needs Linux /proc")
def test_peer_restore_into_state_needs_no_second_copy(tmp_path: Path) -> None:
    """With a persistent checkpoint to fall back on, a 64 MiB shard from a peer lands in the
    state's own tensors: the receiver's peak memory grows by far less than the shard; without
    one, it is received and verified in a buffer of its own first."""
    base, big = str(tmp_path), 16 << 20  # float32s: 64 MiB per rank
    two_nodes = {"local_world_size": 1, "host_store": True, "deadline": 60}
    run_ranks(
        2,
        target=f"{W}:save_steps",
        kwargs={"base": base, "algo": "atomic", "steps": [1, 2], "big": big},
        **two_nodes,
    )
    import shutil

    shutil.rmtree(tmp_path / "node1")  # rank 1 must get its shard from rank 0
    growth = {}
    for min_step in (None, 1):
        outs = run_ranks(
            2,
            target=f"{W}:restore_fresh",
            kwargs={
                "base": base,
                "algo": "atomic",
                "min_step": min_step,
                "big": big,
                "small_parts": False,
            },
            **two_nodes,
        )
        r = outs[1].result
        assert (r["step"], r["tier"], r["ok"]) == (2, "peer", True), r
        growth[min_step] = r["peak_rss_growth_mib"]
    # Measured: 68 MiB into a buffer, 4.6 MiB into the state.
    assert growth[None] > 60, growth  # the shard's own buffer
    assert growth[1] < 16, growth


@pytest.mark.parametrize("algo", ["fully_parallel"])
def test_through_checkpoint_manager(tmp_path: Path, algo: str) -> None:
    outs = run_ranks(
        4,
        target=f"{W}:with_manager",
        kwargs={"base": str(tmp_path), "algo": algo},
        local_world_size=2,
        host_store=True,
        deadline=60,
    )
    for o in outs:
        assert o.result["restart"] == [3, "memory", True], o.result
        tier = "peer" if o.rank in (2, 3) else "local_dir"
        assert o.result["new_manager"] == [3, tier, True], (o.rank, o.result)


@slow("test_lost_node_every_shard_comes_back covers the peer restore; the example, a reserve")
def test_reserve_takes_over_under_restartable(tmp_path: Path) -> None:
    from tests.dist.test_lost_ranks import FAST

    outs = run_ranks(
        6,
        target=f"{W}:restartable_reserve",
        kwargs={"base": str(tmp_path), "config": {**FAST, "active_world_size": 4}},
        local_world_size=2,  # nodes {0,1} {2,3} {4,5}; 4 and 5 are the reserves
        host_store=True,
        deadline=90,
        expect_success=False,
    )
    codes = {o.rank: o.returncode for o in outs}
    assert codes == {0: 0, 1: -signal.SIGKILL, 2: 0, 3: 0, 4: 0, 5: 0}, describe(outs)
    done = {o.rank: o.result["result"] for o in outs if o.result and o.result["result"]}
    assert done[4] == {"iteration": 1, "rank": 1, "step": 3, "tier": "peer", "ok": True}
    for r in (0, 2, 3):
        assert done[r] == {"iteration": 1, "rank": r, "step": 3, "tier": "memory", "ok": True}


def test_a_restart_during_wait_abandons_the_blocked_local_save(tmp_path: Path) -> None:
    outs = run_ranks(
        2,
        target=f"{W}:restart_interrupts_wait",
        kwargs={"base": str(tmp_path)},
        host_store=True,
        deadline=60,
    )
    for o in outs:
        # Step 2 was saved by rank 0 only: step 1 is the newest every rank can restore.
        assert o.result["got"] == 1 and o.result["restored"], o.result
        assert o.result["load_s"] < 20.0, "the blocked save must not be waited for (120 s)"
