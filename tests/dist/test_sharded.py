"""Sharded models under @restartable: FSDP2, tensor parallel and HSDP on a DeviceMesh, both tiers.

Each case trains a small MLP, faults once in iteration 0, and checks that the state restored in
iteration 1 is bit for bit the state saved at the fault's step (parameters and optimizer moments,
gathered in full), from the tier the case is about; that the restart was fast (no destroyed
group kept alive by torch's mesh, FSDP or DTensor caches: no "still referenced" warning); and,
for FSDP, that training ends where a fault-free run ends.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.dist.workers_sharded import reference_digest
from tests.multiproc import RankOutput, describe, run_ranks, slow

W = "tests.dist.workers_sharded:train_sharded"
STEPS, FAULT_STEP = 6, 3
# A warm reserve runs its first DTensor ops after the takeover, while its peers wait in the
# group's first collectives: on a loaded 2-core machine that took more than the 2.5 s group
# timeout of soft_timeout=2 (a failed iteration, then a second restart).
RESERVE = {"active_world_size": 2, "soft_timeout": 5.0, "hard_timeout": 12.0}


def _run(n: int, tmp_path: Path, expect_success: bool = True, **kwargs: Any) -> list[RankOutput]:
    lws = kwargs.pop("local_world_size", 1)
    return run_ranks(
        n,
        target=W,
        kwargs={"base": str(tmp_path), "steps": STEPS, "fault_step": FAULT_STEP, **kwargs},
        local_world_size=lws,
        host_store=True,
        deadline=150,
        expect_success=expect_success,
    )


def _check(outs: list[RankOutput], tiers: dict[int, str], *, exact: bool) -> None:
    """Every rank that finished restored step FAULT_STEP from `tiers[rank]` (its launch rank),
    bit for bit, restarted without a kept group, and (`exact`) ended at the fault-free digest."""
    finished = [o for o in outs if o.result is not None]
    assert finished, describe(outs)
    # The digest is of the full state: the same on every rank that saved it.
    saved = {s["saved_digest"] for o in finished for s in o.result["seen"] if "saved_digest" in s}
    assert len(saved) == 1, saved
    digests = set()
    for o in finished:
        r = o.result
        last = r["seen"][-1]
        if o.rank in tiers:
            assert last["iteration"] == 1, (o.rank, r["seen"])
            assert last["restored"] == [FAULT_STEP, tiers[o.rank]], (o.rank, last)
            assert {last["restored_digest"]} == saved, (o.rank, last)
            assert last["phases"]["barrier"] < 1.5, (o.rank, last["phases"])
        assert not [w for w in r["warnings"] if "still referenced" in w], (o.rank, r["warnings"])
        digests.add(r["result"]["digest"])
    assert len(digests) == 1, digests  # every rank holds the same full state
    if exact:
        assert digests == {reference_digest(STEPS)}


def test_fsdp2_exception_restores_from_memory_bit_for_bit(tmp_path: Path) -> None:
    outs = _run(2, tmp_path, parallel="fsdp", fault="exception")
    _check(outs, {0: "memory", 1: "memory"}, exact=True)


def test_fsdp2_sigkill_a_reserve_takes_the_shards_from_the_node_local_copy(tmp_path: Path) -> None:
    # One node: rank 2 is a warm reserve and reads the killed rank 1's shard from the node's
    # directory (with several nodes it comes from a peer replica: the slow case below).
    outs = _run(
        3,
        tmp_path,
        expect_success=False,
        parallel="fsdp",
        fault="sigkill",
        local_world_size=3,
        options=RESERVE,
    )
    codes = {o.rank: o.returncode for o in outs}
    assert codes == {0: 0, 1: -signal.SIGKILL, 2: 0}, describe(outs)
    _check(outs, {0: "memory"}, exact=True)
    reserve = outs[2].result["seen"]
    assert [s["iteration"] for s in reserve] == [1], reserve
    assert reserve[0]["restored"] == [FAULT_STEP, "local_dir"], reserve


@slow("the FSDP2 exception case covers the DTensor restore; this one adds TP and Stateful")
def test_tp_dcp_stateful_exception_restores_from_memory(tmp_path: Path) -> None:
    # get_state_dict / set_state_dict (a DCP Stateful), as DCP recipes pass it.
    outs = _run(2, tmp_path, parallel="tp", fault="exception", dcp_state=True)
    _check(outs, {0: "memory", 1: "memory"}, exact=False)


def test_another_mesh_after_the_restart_falls_back_to_the_persistent_tier(tmp_path: Path) -> None:
    # The restart builds the mesh with other dim names: the local shard is refused on every rank
    # with both shardings named, and the persistent step (2) loads instead.
    outs = _run(2, tmp_path, parallel="fsdp", fault="exception", remesh=True, persistent_every=2)
    for o in outs:
        last = o.result["seen"][-1]
        assert last["restored"] == [2, "persistent"], (o.rank, last)
        refused = [w for w in o.result["warnings"] if "do not fit the live mesh" in w]
        assert len(refused) == 1, o.result["warnings"]
        assert "saved mesh [2] (dp)" in refused[0] and "live mesh [2] (fsdp)" in refused[0]


@slow("the exception case covers the restore; this one adds the re-run machine on FSDP2")
def test_fsdp2_nan_is_re_run_in_place(tmp_path: Path) -> None:
    outs = _run(2, tmp_path, parallel="fsdp", fault="nan")
    for o in outs:
        first = o.result["seen"][0]  # the step ran twice with the same data, in place
        assert first["attempts"][str(FAULT_STEP + 1)] == 2, first
    _check(outs, {}, exact=True)


@slow("the node-local reserve case covers the takeover; this one restores from a peer")
def test_fsdp2_sigkill_a_reserve_on_another_node_takes_a_peer_replica(tmp_path: Path) -> None:
    outs = _run(
        3,
        tmp_path,
        expect_success=False,
        parallel="fsdp",
        fault="sigkill",
        local_dir=False,
        options=RESERVE,
    )
    assert {o.rank: o.returncode for o in outs} == {0: 0, 1: -signal.SIGKILL, 2: 0}
    _check(outs, {0: "memory"}, exact=True)
    assert outs[2].result["seen"][0]["restored"] == [FAULT_STEP, "peer"]


@slow("persistent loads of DTensors are DCP's own; the memory case covers the restart")
def test_fsdp2_persistent_tier_only(tmp_path: Path) -> None:
    outs = _run(2, tmp_path, parallel="fsdp", fault="exception", local=False, persistent_every=3)
    _check(outs, {0: "persistent", 1: "persistent"}, exact=True)


@slow("TP's restore is the exception case's; this one adds a reserve")
def test_tp_sigkill_a_reserve_takes_over(tmp_path: Path) -> None:
    outs = _run(
        3,
        tmp_path,
        expect_success=False,
        parallel="tp",
        fault="sigkill",
        local_world_size=3,
        options=RESERVE,
    )
    assert {o.rank: o.returncode for o in outs} == {0: 0, 1: -signal.SIGKILL, 2: 0}
    _check(outs, {0: "memory"}, exact=False)


@slow("4 ranks on a 2 x 2 mesh")
@pytest.mark.parametrize("fault", ["exception", "sigkill", "nan"])
def test_hsdp_2x2_mesh(tmp_path: Path, fault: str) -> None:
    extra: dict[str, Any] = {}
    n, tiers = 4, {0: "memory", 1: "memory", 2: "memory", 3: "memory"}
    if fault == "sigkill":
        n, tiers = 5, {0: "memory", 2: "memory", 3: "memory"}
        extra = {"local_world_size": 5, "options": {**RESERVE, "active_world_size": 4}}
    if fault == "nan":
        tiers = {}
    outs = _run(
        n, tmp_path, expect_success=fault != "sigkill", parallel="hsdp", fault=fault, **extra
    )
    _check(outs, tiers, exact=True)
