"""Attribution rules, table by table: each planted pattern gets its origin and evidence."""

from __future__ import annotations

from typing import Any

from inprocess.report import attribution


def _fault(launch: str, host: str, rank: int, step: int, **kw: Any) -> dict[str, Any]:
    return {
        "event": "fault", "t": kw.pop("t", float(step)), "launch": launch, "host": host,
        "rank": rank, "fault_rank": rank, "iteration": kw.pop("iteration", 0),
        "kind": kw.pop("kind", "exception"), "exc_type": kw.pop("exc_type", "RuntimeError"),
        "where": kw.pop("where", "train.py:10"), "step": step, "detail": kw.pop("detail", ""),
        **kw,
    }  # fmt: skip


def _findings(records: list[dict[str, Any]]) -> dict[tuple[str, int], attribution.Finding]:
    found = attribution.attribute(attribution.faults_of(records))
    return {(f.fault.launch, f.fault.iteration): f for f in found}


def test_three_launches_with_planted_patterns() -> None:
    records = [
        # A node that faults at different steps in two launches: hardware.
        _fault("a", "node7", 3, 120, where="model.py:40", exc_type="RuntimeError"),
        _fault("b", "node7", 1, 310, where="opt.py:9", exc_type="OSError", iteration=1),
        # A NaN at the same step and place on two different nodes: application.
        _fault("b", "node2", 0, 500, exc_type="FloatingPointError", where="loss.py:3", iteration=2),
        _fault("c", "node5", 2, 500, exc_type="FloatingPointError", where="loss.py:3"),
        # A storage error: infrastructure.
        _fault("c", "node1", 0, 90, exc_type="CheckpointRankError", iteration=1,
               detail="save of step 90 failed: OSError: [Errno 28] No space left on device"),
    ]  # fmt: skip
    f = _findings(records)
    assert f[("a", 0)].origin == "hardware" and f[("b", 1)].origin == "hardware"
    assert f[("a", 0)].exclude == "--exclude=node7" and f[("a", 0)].steps == [120, 310]
    assert f[("b", 2)].origin == "application" and f[("c", 0)].origin == "application"
    assert f[("b", 2)].hosts == ["node2", "node5"] and f[("b", 2)].fault_class == "numerical"
    assert f[("c", 1)].origin == "infrastructure" and f[("c", 1)].rule == "storage error"


def test_a_single_fault_is_unknown_and_hangs_are_hangs() -> None:
    f = _findings([_fault("a", "node1", 0, 5, kind="soft_timeout", exc_type="")])
    assert f[("a", 0)].origin == "unknown" and f[("a", 0)].fault_class == "hang"


def test_collective_failures_follow_their_peer_unless_many_fail_alone() -> None:
    root = _fault("a", "n1", 1, 5)
    victim = _fault("a", "n2", 0, 5, in_collective=True, exc_type="DistError")
    assert list(_findings([root, victim])) == [("a", 0)]
    assert _findings([root, victim])[("a", 0)].fault.rank == 1
    burst = [_fault("b", f"n{r}", r, 9, in_collective=True, exc_type="DistError") for r in range(4)]
    found = attribution.attribute(attribution.faults_of(burst))
    assert {x.origin for x in found} == {"infrastructure"}


def test_failed_health_check_is_hardware() -> None:
    f = _findings([_fault("a", "gpu-node3", 2, 0, kind="unhealthy", exc_type="")])
    assert f[("a", 0)].origin == "hardware" and f[("a", 0)].exclude == "--exclude=gpu-node3"
