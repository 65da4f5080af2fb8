"""Attribution rules, table by table: each planted pattern gets its origin and evidence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from restartable.inprocess.report import attribution


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
    # Two hosts: an --exclude line is advice only where another host can take the work.
    other = _fault("b", "gpu-node4", 0, 7, kind="soft_timeout", exc_type="")
    f = _findings([_fault("a", "gpu-node3", 2, 0, kind="unhealthy", exc_type=""), other])
    assert f[("a", 0)].origin == "hardware" and f[("a", 0)].exclude == "--exclude=gpu-node3"


# --- one finding per fault window: the demo's journal and a multi-launch set ------------------

DEMO = Path(__file__).parent / "data" / "demo_journal.jsonl"  # the README demo's journal, as
# written by `inprocess.launch --nproc-per-node 4 examples/train.py --faults demo` (its
# per-step "step"/"save" records left out: attribution reads none of them)
DEMO_CLASSES = ["exception", "kill", "hang", "numerical", "exception"]
DEMO_FAULTS = ["exception@rank1:step50", "kill@rank1:step100", "hang@rank0:step150",
               "nan@rank1:step200", "exception@rank0:step250"]  # fmt: skip


def _demo() -> list[dict[str, Any]]:
    return [json.loads(line) for line in DEMO.read_text().splitlines()]


def test_the_demo_gets_five_findings_for_its_five_faults() -> None:
    found = attribution.analyse(_demo())
    assert [f.fault_class for f in found] == DEMO_CLASSES
    assert [f.fault.injected for f in found] == DEMO_FAULTS
    assert {f.origin for f in found} == {"injected"}
    # Each names the rank as the plan does, and the step it fired at.
    assert [(f.fault.training_rank, f.fault.step) for f in found] == [
        (1, 50), (1, 100), (0, 150), (1, 200), (0, 250)
    ]  # fmt: skip
    assert [f.fault.rank for f in found] == [1, 1, 0, 3, 0]  # initial ranks: 3 took 1's place


def test_the_demo_without_its_plan_is_never_hardware_on_its_one_host() -> None:
    # The same journal as if nothing had been injected: the rules alone must not blame the
    # only host there is, nor advise excluding it.
    found = attribution.analyse([r for r in _demo() if r["event"] != "fault_fired"])
    assert [f.fault_class for f in found] == DEMO_CLASSES
    assert all(f.origin == "unknown" and not f.exclude for f in found), [f.line() for f in found]


def _restart(launch: str, it: int, cause: str, t: float, before: list[int]) -> dict[str, Any]:
    rank = int(cause.split(" on rank ")[1].split()[0])
    return {"event": "restart", "t": t, "launch": launch, "host": "n0", "rank": 0,
            "iteration": it, "cause": cause, "faulting_ranks": [rank],
            "active_before": before}  # fmt: skip


def test_a_multi_launch_set_classifies_each_window_once() -> None:
    ranks = [0, 1, 2, 3]
    # Launches a and c ran ranks 0, 1 on n0 and 2, 3 on n1; the requeued launch b got n2, n3.
    host = {("a", 0): "n0", ("a", 1): "n0", ("a", 2): "n1", ("a", 3): "n1",
            ("b", 0): "n2", ("b", 1): "n2", ("b", 2): "n3", ("b", 3): "n3"}  # fmt: skip
    host.update({("c", r): h for (launch, r), h in host.items() if launch == "a"})
    records = [
        *[{"event": "job_start", "t": t, "launch": launch, "host": host[(launch, r)], "rank": r}
          for launch, t in (("a", 0.0), ("b", 9.0), ("c", 19.0)) for r in ranks],
        # Launch a: a bug every rank hits at the same line (a restart each time).
        *[_fault("a", host[("a", r)], r, 7, t=1.0 + r / 100, where="model.py:12") for r in ranks],
        _restart("a", 1, "exception on rank 0", 1.2, ranks),
        # Launch a: rank 2 killed (no record of its own; its peers' collectives broke).
        _fault("a", "n0", 0, 9, iteration=1, t=3.0, in_collective=True, exc_type="DistError"),
        _fault("a", "n0", 1, 9, iteration=1, t=3.0, in_collective=True, exc_type="DistError"),
        _restart("a", 2, "dead on rank 2 (collateral, not counted: rank(s) 0, 1)", 3.1, ranks),
        # Launch b: a hard-timeout kill of a GIL-held hang; then a NaN every rank re-ran.
        _restart("b", 1, "hard_timeout on rank 3", 10.0, ranks),
        *[{"event": "rerun_verdict", "t": 12.0 + r / 100, "launch": "b",
           "host": host[("b", r)], "rank": r, "training_rank": r, "iteration": 1, "step": 30,
           "verdict": "transient_error"} for r in ranks],
        _fault("b", "n2", 1, 29, iteration=1, t=12.1,
               exc_type="rerun.errors.RerunExit"),  # names: keep (an old journal)
        # Launch c: a straggler swapped out; a disk full; a CUDA error on n1; another fault on
        # n1, which lost rank 2 in launch a as well.
        _fault("c", "n0", 0, 40, kind="straggler", exc_type="", t=20.0),
        _fault("c", "n0", 1, 50, iteration=1, t=21.0, exc_type="CheckpointStorageError",
               detail="[Errno 28] No space left on device"),
        _fault("c", "n1", 2, 60, iteration=2, t=22.0,
               detail="CUDA error: an illegal memory access was encountered"),
        _fault("c", "n1", 3, 70, iteration=3, t=23.0, where="data.py:3"),
    ]  # fmt: skip
    found = attribution.analyse(sorted(records, key=lambda r: r["t"]))
    got = [(f.fault.launch, f.fault.iteration, f.fault_class, f.origin) for f in found]
    assert got == [
        ("a", 0, "exception", "application"),
        ("a", 1, "kill", "hardware"),  # n1 faulted again in launch c
        ("b", 0, "hang", "unknown"),
        ("b", 1, "numerical", "unknown"),
        ("c", 0, "straggler", "unknown"),
        ("c", 1, "exception", "infrastructure"),
        ("c", 2, "exception", "hardware"),
        ("c", 3, "exception", "hardware"),
    ], [f.line() for f in found]
    assert found[0].ranks == ranks and found[0].hosts == ["n0", "n1"] and not found[0].exclude
    assert (found[1].fault.rank, found[1].fault.training_rank, found[1].fault.host) == (2, 2, "n1")
    assert found[2].fault.host == "n3" and found[3].fault.rank == 1
    assert [f.exclude for f in found if f.origin == "hardware"] == ["--exclude=n1"] * 3
    assert all(not f.exclude for f in found if f.origin != "hardware")


def test_recurrence_on_the_only_host_is_no_evidence() -> None:
    a = _fault("a", "vm", 0, 5, where="x.py:1")
    b = _fault("b", "vm", 1, 9, where="y.py:2")
    found = attribution.analyse([a, b])
    assert [f.origin for f in found] == ["unknown", "unknown"] and not any(f.exclude for f in found)


def test_a_restart_that_blames_a_collective_failure_is_one_infrastructure_finding() -> None:
    # Seen under load: after a kill, the re-formed group timed out on every rank (gloo); the
    # policy counted rank 0's record as its own. One window, one finding, no invented fault.
    records = [
        _fault("a", "vm", r, 100, iteration=2, t=10.0 + r / 10, in_collective=True,
               exc_type="builtins.RuntimeError", detail="Timed out waiting 2500ms for send")
        for r in (0, 2, 3)
    ] + [_restart("a", 3, "exception on rank 0 (collateral, not counted: rank(s) 2, 3)", 10.5,
                  [0, 3, 2])]  # fmt: skip
    (f,) = attribution.analyse(records)
    assert (f.fault.iteration, f.origin) == (2, "infrastructure"), f.line()
