"""Downtime terms from journal records: they add up to the wall time, and a fault's downtime is
the gap in rank 0's progress around it."""

from __future__ import annotations

from typing import Any

import pytest

from restartable.inprocess import report
from restartable.inprocess.report import downtime, terms


def _steps(t0: float, first: int, n: int, dt: float, it: int) -> list[dict[str, Any]]:
    return [
        {"t": t0 + i * dt, "event": "step", "step": first + i, "training_rank": 0, "iteration": it}
        for i in range(n)
    ]


def _run_with_one_fault() -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = [{"t": 0.0, "event": "job_start"}]
    recs += _steps(1.0, 0, 11, 0.1, 0)  # steps 0..10 at 1.0 .. 2.0
    recs += [
        {"t": 2.05, "event": "fault_fired", "iteration": 0, "kind": "hang",
         "fault": "hang@rank1:step10"},
        {"t": 4.05, "event": "fault", "iteration": 0, "kind": "soft_timeout", "fault_rank": 1},
        {"t": 4.2, "event": "iteration_start", "iteration": 1},
        {"t": 4.3, "event": "restart", "iteration": 1, "cause": "soft_timeout on rank 1",
         "faulting_ranks": [1], "phases": {}},
        {"t": 4.4, "event": "restore", "iteration": 1, "training_rank": 0, "tier": "memory",
         "step": 8},
    ]  # fmt: skip
    recs += _steps(4.5, 8, 13, 0.1, 1)  # steps 8..20 at 4.5 .. 5.7; step 10 again at 4.7
    recs += [{"t": 6.0, "event": "job_end"}]
    return sorted(recs, key=lambda r: r["t"])


def test_terms_of_a_hang_and_their_sum() -> None:
    r = downtime.build(_run_with_one_fault())
    (w,) = r.windows
    t = w.terms
    assert t["lost_before"] == pytest.approx(0.05)
    assert t["detection"] == pytest.approx(2.0)  # the soft timeout is detection, not restart
    assert t["restart"] == pytest.approx(0.15)
    assert t["reload"] == pytest.approx(0.2)
    assert t["redo"] == pytest.approx(0.3)  # steps 8, 9 again; back at step 10 at 4.7
    assert t["downtime"] == pytest.approx(4.7 - 2.0)
    assert r.wall == pytest.approx(6.0)
    assert r.startup + r.productive + r.downtime == pytest.approx(r.wall)
    assert (w.tier, w.restored_step, w.reached_step) == ("memory", 8, 10)


def test_a_second_restart_inside_a_window_extends_it() -> None:
    recs = _run_with_one_fault()
    recs += [
        {"t": 4.45, "event": "fault", "iteration": 1, "kind": "exception", "fault_rank": 0},
        {"t": 4.46, "event": "iteration_start", "iteration": 2},
        {"t": 4.47, "event": "restart", "iteration": 2, "cause": "exception on rank 0",
         "faulting_ranks": [0], "phases": {}},
    ]  # fmt: skip
    r = downtime.build(sorted(recs, key=lambda x: x["t"]))
    assert len(r.windows) == 1
    assert r.windows[0].last == pytest.approx(2.0) and r.windows[0].back == pytest.approx(4.7)
    # The row is the first fault's (the hang on rank 1, detected at 4.05), not the later one's.
    w = r.windows[0]
    assert (w.iteration, w.kind, w.faulting_ranks, w.fault) == (0, "soft_timeout", [1],
                                                                "hang@rank1:step10")  # fmt: skip
    assert w.terms["detection"] == pytest.approx(2.0)
    assert sum(v for k, v in w.terms.items() if k != "downtime") == pytest.approx(
        w.terms["downtime"]
    )


def test_a_journal_without_steps_says_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"ctx.ping\(step\)"):
        downtime.build([{"t": 0.0, "event": "job_start"}, {"t": 1.0, "event": "job_end"}])


def test_the_window_names_the_injected_fault_in_the_dict_and_the_text() -> None:
    r = downtime.build(_run_with_one_fault())
    assert r.windows[0].fault == "hang@rank1:step10"
    (row,) = r.as_dict()["faults"]
    assert row["fault"] == "hang@rank1:step10" and row["kind"] == "soft_timeout"
    terms = ("lost_before_s", "detection_s", "restart_s", "reload_s", "redo_s")
    assert sum(row[k] for k in terms) == pytest.approx(row["downtime_s"])
    text = report.format_report(r)
    assert "hang@rank1:step10" in text
    # Every column says its unit; no "seconds(steps)" packed into one cell.
    for header in ("lost-before [s]", "detect [s]", "restart [s]", "reload [s]", "redo [s]",
                   "downtime [s]", "from step", "back at step"):  # fmt: skip
        assert header in text
    (row_text,) = [line for line in text.splitlines() if "hang@rank1:step10" in line]
    assert "(" not in row_text and "2.700" in row_text


def test_a_fault_fired_before_the_first_iteration_began_names_its_window() -> None:
    # The config's drill can fire while iteration 0's health check still runs (CUDA's start on a
    # GPU host): its record has no iteration yet.
    recs = _run_with_one_fault()
    for r in recs:
        if r["event"] == "fault_fired":
            del r["iteration"]
    assert downtime.build(recs).windows[0].fault == "hang@rank1:step10"


def test_a_fault_that_was_not_injected_has_no_name() -> None:
    recs = [r for r in _run_with_one_fault() if r["event"] != "fault_fired"]
    (w,) = downtime.build(recs).windows
    assert w.fault is None and w.sign == pytest.approx(4.05)  # its first sign: the fault record
    rows = [line for line in report.format_report(downtime.build(recs)).splitlines()]
    assert any(line.startswith("  -  ") and "soft_timeout" in line for line in rows), rows


def test_checkpoint_stalls_count_outside_fault_windows_only() -> None:
    recs = _run_with_one_fault()
    recs += [
        {"t": 1.5, "event": "save", "training_rank": 0, "stall_s": 0.01},
        {"t": 3.0, "event": "save", "training_rank": 0, "stall_s": 0.5},  # inside the window
        {"t": 5.0, "event": "save", "training_rank": 0, "stall_s": 0.02},
        {"t": 5.0, "event": "save", "training_rank": 1, "stall_s": 0.7},  # rank 0's only
    ]
    r = downtime.build(sorted(recs, key=lambda x: x["t"]))
    assert r.checkpoint == pytest.approx(0.03)
    assert r.downtime == pytest.approx(0.03 + r.windows[0].terms["downtime"])
    assert r.startup + r.productive + r.downtime == pytest.approx(r.wall)
    assert r.goodput == pytest.approx(r.productive / r.wall)


def test_a_dead_rank_is_detected_by_the_first_fault_record_of_its_peers() -> None:
    # A killed rank writes no fault record: its peer's failed collective is the detection.
    recs = [r for r in _run_with_one_fault() if r["event"] != "fault"]
    recs += [
        {"t": 2.3, "event": "fault", "iteration": 0, "kind": "collective", "fault_rank": 0,
         "in_collective": True},
    ]  # fmt: skip
    (w,) = downtime.build(sorted(recs, key=lambda x: x["t"])).windows
    assert w.terms["detection"] == pytest.approx(0.25)
    assert w.terms["restart"] == pytest.approx(4.2 - 2.3)


# ----- the launcher's recovery levels: respawn and in-job restart ----------------------------

_LAUNCHER = {"rank": -1, "host": "h", "pid": 99}


def _kill_and_respawn() -> list[dict[str, Any]]:
    """Rank 1 (pid 11) is killed at step 10: the peers restart in place (a reserve takes over),
    and the launcher respawns rank 1's slot; the new process (identity 5) registers at 3.5."""
    recs = [r for r in _run_with_one_fault() if r["event"] not in ("fault_fired", "fault")]
    for r in recs:
        r.update(host="h", pid=10, rank=0)
    recs += [
        {"t": 1.5, "event": "step", "step": 5, "host": "h", "pid": 11, "rank": 1,
         "training_rank": 1, "iteration": 0},
        {"t": 2.05, "event": "fault_fired", "iteration": 0, "kind": "kill",
         "fault": "kill@rank1:step10", "host": "h", "pid": 11, "rank": 1},
        {"t": 2.1, "event": "fault", "iteration": 0, "kind": "dead", "fault_rank": 1,
         "host": "h", "pid": 10, "rank": 0},
        {"t": 2.2, "event": "respawn", "slot_rank": 1, "identity": 1, "how":
         "was killed by SIGKILL", "delay_s": 0.0, "proc_pid": 11, **_LAUNCHER},
        {"t": 2.25, "event": "respawn_started", "slot_rank": 1, "identity": 5, "replaces": 1,
         "generation": 1, "proc_pid": 15, **_LAUNCHER},
        {"t": 3.5, "event": "reserve_ready", "identity": 5, "host": "h", "pid": 15, "rank": 5},
    ]  # fmt: skip
    return sorted(recs, key=lambda r: r["t"])


def test_a_respawn_is_a_window_of_its_own_outside_the_downtime_sum() -> None:
    r = downtime.build(_kill_and_respawn())
    (rw,) = r.respawn_windows
    assert (rw.slot_rank, rw.identity, rw.new_identity) == (1, 1, 5)
    assert rw.fault == "kill@rank1:step10"  # the dead process's own last record
    t = rw.terms
    assert t["detection"] == pytest.approx(0.15)  # the kill -> the launcher saw the exit
    assert t["start"] == pytest.approx(0.05)
    assert t["join"] == pytest.approx(1.25)  # start -> a ready reserve
    assert t["recovery"] == pytest.approx(1.3)
    # The training's downtime is the in-process window's alone: the pool refilled meanwhile.
    (w,) = r.windows
    assert w.fault == "kill@rank1:step10" and r.downtime == pytest.approx(w.terms["downtime"])
    assert r.startup + r.productive + r.downtime == pytest.approx(r.wall)
    assert r.respawns == 1
    (row,) = r.as_dict()["respawn_windows"]
    assert row["recovery_s"] == pytest.approx(1.3) and row["how"] == "was killed by SIGKILL"
    text = report.format_report(r)
    assert "respawns (outside the downtime" in text
    (line,) = [x for x in text.splitlines() if "was killed by SIGKILL" in x]
    assert "kill@rank1:step10" in line and "1.300" in line and "0.150" in line


def test_a_respawn_that_never_became_ready_has_no_recovery() -> None:
    recs = [r for r in _kill_and_respawn() if r["event"] != "reserve_ready"]
    (rw,) = downtime.build(recs).respawn_windows
    assert rw.terms["recovery"] is None and rw.terms["join"] is None
    assert rw.terms["start"] == pytest.approx(0.05)
    text = report.format_report(downtime.build(recs))
    (line,) = [x for x in text.splitlines() if "was killed by SIGKILL" in x]
    assert line.split()[-2:] == ["-", "-"], line  # join and recovery: never ready


def _proc(pid: int, recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, "host": "h", "pid": pid, "rank": pid % 2} for r in recs]


def _in_job_restart() -> list[dict[str, Any]]:
    """Round 0 (pids 1, 2): an injected fault at 2.05 stops the in-process path; the launcher
    sees the decision at 2.3 and starts round 1 (pids 3, 4) at 3.0, which restores step 8 and
    has an in-process restart of its own (its iteration 0 again, at 4.95)."""
    round0 = [
        {"t": 0.0, "event": "job_start"},
        {"t": 0.1, "event": "iteration_start", "iteration": 0},
        *_steps(1.0, 0, 11, 0.1, 0),
        {"t": 2.05, "event": "fault_fired", "iteration": 0, "kind": "exception",
         "fault": "exception@rank1:step10"},
        {"t": 2.1, "event": "fault", "iteration": 0, "kind": "exception", "fault_rank": 0},
        {"t": 2.5, "event": "job_end", "outcome": "stopped"},
    ]  # fmt: skip
    round1 = [
        {"t": 3.5, "event": "job_start"},
        {"t": 4.0, "event": "iteration_start", "iteration": 0},
        {"t": 4.2, "event": "restore", "iteration": 0, "training_rank": 0, "tier": "local_dir",
         "step": 8},
        *_steps(4.3, 8, 7, 0.1, 0),  # steps 8..14 at 4.3 .. 4.9; step 10 again at 4.5
        {"t": 4.95, "event": "fault", "iteration": 0, "kind": "exception", "fault_rank": 0},
        {"t": 5.1, "event": "iteration_start", "iteration": 1},
        {"t": 5.15, "event": "restart", "iteration": 1, "cause": "exception on rank 0",
         "faulting_ranks": [0], "phases": {}},
        {"t": 5.2, "event": "restore", "iteration": 1, "training_rank": 0, "tier": "memory",
         "step": 14},
        *_steps(5.3, 14, 7, 0.1, 1),
        {"t": 6.0, "event": "job_end", "outcome": "done"},
    ]  # fmt: skip
    launcher = [
        {"t": 3.0, "event": "in_job_restart", "round": 1, "decided": 2.3,
         "reason": "the in-process restart gave up: max_iterations (1) reached", **_LAUNCHER},
    ]  # fmt: skip
    recs = _proc(1, round0) + _proc(2, round0[:1]) + _proc(3, round1) + _proc(4, round1[:1])
    return sorted(recs + launcher, key=lambda r: r["t"])


def test_an_in_job_restart_is_a_window_with_its_own_detection_and_recovery() -> None:
    r = downtime.build(_in_job_restart())
    assert r.in_job_restarts == 1 and r.restarts == 1  # round 1's in-process restart
    first, second = r.windows
    assert (first.level, first.kind, first.round) == (terms.IN_JOB, "in_job_restart", 0)
    assert first.fault == "exception@rank1:step10" and "max_iterations" in first.cause
    t = first.terms
    assert t["detection"] == pytest.approx(0.25)  # the fault -> the launcher saw the decision
    assert t["restart"] == pytest.approx(1.7)  # -> the new round's ranks entered iteration 0
    assert t["reload"] == pytest.approx(0.2)
    assert t["redo"] == pytest.approx(0.3)  # steps 8, 9 again; back at step 10 at 4.5
    assert t["downtime"] == pytest.approx(2.5)
    assert first.recovery == pytest.approx(4.3 - 2.3)  # the restarted job's first step
    assert first.tier == "local_dir" and first.restored_step == 8
    # Round 1's iteration 0 is not round 0's: its own fault record (4.95) is its detection.
    assert (second.level, second.round, second.iteration) == (terms.IN_PROCESS, 1, 0)
    assert second.detected == pytest.approx(4.95) and second.tier == "memory"
    assert r.startup + r.productive + r.downtime == pytest.approx(r.wall)
    text = report.format_report(r)
    assert "in-job restarts 1" in text
    (row,) = [x for x in text.splitlines() if "exception@rank1:step10" in x]
    assert "in-job" in row and "2.500" in row
    (d,) = [f for f in r.as_dict()["faults"] if f["level"] == terms.IN_JOB]
    assert d["recovery_s"] == pytest.approx(2.0) and d["detection_s"] == pytest.approx(0.25)
