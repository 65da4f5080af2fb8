"""The example's event log and its downtime report (JSON, a printed table, an optional PNG).

Every rank appends events to ``EVENTS_DIR/rank<initial rank>.jsonl`` (flushed per line, so a
SIGKILLed rank loses nothing it already wrote); each launch of a job has its own EVENTS_DIR.
After training, one rank builds the report:

    downtime = checkpoint overhead + sum over faults of (detection + recovery)
    recovery = shutdown/restart + state reload + lost work (recomputed steps)

and ``wall = startup + productive + downtime`` by construction, so goodput = productive / wall.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any


class EventLog:
    """Append-only JSONL event file of one rank (owner of the file handle)."""

    def __init__(self, events_dir: Path, initial_rank: int) -> None:
        path = events_dir / f"rank{initial_rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - owned, closed in close()
        self.initial_rank = initial_rank

    def emit(self, event: str, **fields: Any) -> None:
        record = {"ev": event, "t": time.time(), "initial_rank": self.initial_rank, **fields}
        self._f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def read_events(events_dir: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(events_dir.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return sorted(events, key=lambda e: float(e["t"]))


def build_report(
    events_dir: Path, *, faults: list[dict[str, Any]], wall_end: float
) -> dict[str, Any]:
    """Compute the downtime report of one launch from its events and the fired-fault markers.

    The launch starts at its earliest "start" event; faults fired by earlier launches of the
    same run directory are left out.
    """
    events = read_events(events_dir)
    wall_start = min(float(e["t"]) for e in events if e["ev"] == "start")
    faults = [f for f in faults if float(f["time"]) >= wall_start]
    steps = [e for e in events if e["ev"] == "step" and e["rank"] == 0]
    step_times = [float(e["seconds"]) for e in steps]
    median_step = statistics.median(step_times) if step_times else 0.0
    saves = [e for e in events if e["ev"] == "save" and e["rank"] == 0]
    ckpt_overhead = sum(float(e["stall"]) for e in saves)
    first_step = min((float(e["t"]) - float(e["seconds"]) for e in steps), default=wall_start)

    per_fault = []
    for fault in faults:
        t_fault = float(fault["time"])
        record: dict[str, Any] = {"fault": fault["fault"], "kind": fault["kind"]}
        rerun = _rerun_fault_terms(events, t_fault) if fault["kind"] == "nan" else None
        if rerun is None or not rerun["recovered"]:
            # A fault that ended train() (also a NaN on a stack without re-run machinery, the
            # goodput baseline, where it crashes the step): the next restart recovers from it.
            record.update(_restart_fault_terms(events, t_fault, median_step))
        else:
            # A NaN is re-run in place first; a verdict that rolls back (a transient fault may
            # have corrupted the state: resume from the last checkpoint) then also restarts.
            t_verdict = rerun.pop("t")
            restart = _restart_fault_terms(
                events, t_fault, median_step, detection=rerun["lost_work_s"], until=t_verdict
            )
            record.update(restart if restart["recovered"] else rerun)
            record["verdict"] = rerun["verdict"]
        record["downtime_s"] = round(
            record["detection_s"]
            + record["shutdown_restart_s"]
            + record["reload_s"]
            + record["lost_work_s"],
            4,
        )
        per_fault.append(record)

    wall = wall_end - wall_start
    startup = max(0.0, first_step - wall_start)
    downtime = ckpt_overhead + sum(f["downtime_s"] for f in per_fault)
    productive = max(0.0, wall - startup - downtime)
    restarts = len({e["iteration"] for e in events if e["ev"] == "enter"}) - 1
    final = [e for e in events if e["ev"] == "done" and e.get("rank") == 0]
    return {
        "faults": per_fault,
        "totals": {
            "wall_s": round(wall, 3),
            "startup_s": round(startup, 3),
            "checkpoint_overhead_s": round(ckpt_overhead, 4),
            "fault_downtime_s": round(sum(f["downtime_s"] for f in per_fault), 4),
            "downtime_s": round(downtime, 4),
            "productive_s": round(productive, 3),
            "goodput": round(productive / wall, 4) if wall > 0 else 0.0,
            "restarts": restarts,
            "median_step_s": round(median_step, 5),
            "checkpoint_saves": len(saves),
            "final_loss": final[-1]["loss"] if final else None,
            "final_step": final[-1]["step"] if final else None,
        },
        "timeline": [{"t": round(float(e["t"]) - wall_start, 4), "step": e["step"]} for e in steps],
        "restart_times": sorted(
            {round(float(e["t"]) - wall_start, 4) for e in events if e["ev"] == "enter"}
        ),
        "fault_times": [round(float(f["time"]) - wall_start, 4) for f in faults],
    }


def _restart_fault_terms(
    events: list[dict[str, Any]],
    t_fault: float,
    median_step: float,
    *,
    detection: float | None = None,
    until: float | None = None,
) -> dict[str, Any]:
    """Terms of a fault that restarted train(): the first re-entry after the fault.

    ``detection``: seconds known to be detection (else the wrapper's detect phase);
    ``until``: the restart must begin before this time (None: any later restart).
    """
    after = [e for e in events if float(e["t"]) >= t_fault]
    enters = [e for e in after if e["ev"] == "enter"]
    if until is not None:
        first_step_after = min(
            (float(e["t"]) for e in after if e["ev"] == "step" and float(e["t"]) > until),
            default=None,
        )
        if first_step_after is not None:
            enters = [e for e in enters if float(e["t"]) < first_step_after]
    if not enters:  # the job ended before recovering (its error is in the logs)
        return {
            "detection_s": 0.0,
            "shutdown_restart_s": 0.0,
            "reload_s": 0.0,
            "lost_work_s": 0.0,
            "lost_steps": 0,
            "tier": None,
            "recovered": False,
        }
    iteration = enters[0]["iteration"]
    same = [e for e in enters if e["iteration"] == iteration]
    t_enter = max(float(e["t"]) for e in same)  # every active rank is back in train()
    phases = same[0].get("restart") or {}
    if detection is None:
        detection = float(phases.get("detect_s", 0.0))
    restored = [e for e in after if e["ev"] == "restored" and e["iteration"] == iteration]
    reload = max((float(e["seconds"]) for e in restored), default=0.0)
    fault_step = next(
        (int(e["step"]) for e in reversed(events) if e["ev"] == "step" and float(e["t"]) < t_fault),
        -1,
    )
    restored_step = int(restored[0]["step"]) if restored else 0
    lost_steps = max(0, fault_step + 1 - restored_step)
    return {
        "detection_s": round(min(detection, t_enter - t_fault), 4),
        "shutdown_restart_s": round(t_enter - t_fault - min(detection, t_enter - t_fault), 4),
        "reload_s": round(reload, 4),
        "lost_steps": lost_steps,
        "lost_work_s": round(lost_steps * median_step, 4),
        "tier": restored[0].get("tier") if restored else None,
        "restored_step": restored_step,
        "iteration": iteration,
        "recovered": True,
    }


def _rerun_fault_terms(events: list[dict[str, Any]], t_fault: float) -> dict[str, Any]:
    reruns = [e for e in events if e["ev"] == "rerun" and float(e["t"]) >= t_fault]
    rerun = reruns[0] if reruns else {}
    return {
        "t": float(rerun.get("t", t_fault)),
        "detection_s": round(float(rerun.get("detect_s", 0.0)), 4),
        "shutdown_restart_s": 0.0,
        "reload_s": 0.0,
        "lost_steps": 0,
        "lost_work_s": round(float(rerun.get("rerun_s", 0.0)), 4),
        "tier": None,
        "verdict": rerun.get("verdict"),
        "recovered": bool(rerun),
    }


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table printed at the end of the example."""
    t = report["totals"]
    lines = ["", "=== downtime report ==="]
    if report["faults"]:
        lines.append(
            f"{'fault':34} {'detect':>7} {'restart':>8} {'reload':>7} {'lost':>10} {'down':>7}  "
            "tier"
        )
    else:
        lines.append("no fault fired in this launch (--faults none, or fired in an earlier one)")
    for f in report["faults"]:
        lost = f"{f['lost_work_s']:.3f}({f['lost_steps']})"
        lines.append(
            f"{f['fault']:34} {f['detection_s']:7.3f} {f['shutdown_restart_s']:8.3f} "
            f"{f['reload_s']:7.3f} {lost:>10} {f['downtime_s']:7.3f}  "
            f"{f.get('tier') or f.get('verdict') or '-'}"
        )
    lines += [
        f"checkpoint overhead: {t['checkpoint_overhead_s']:.3f} s "
        f"over {t['checkpoint_saves']} saves",
        f"downtime: {t['downtime_s']:.3f} s   wall: {t['wall_s']:.3f} s   "
        f"startup: {t['startup_s']:.3f} s   productive: {t['productive_s']:.3f} s",
        f"goodput: {t['goodput']:.1%}   restarts: {t['restarts']}   final loss: {t['final_loss']}",
    ]
    return "\n".join(lines)


def write_png(report: dict[str, Any], path: Path) -> None:
    """Steps over time with faults and restarts marked (needs matplotlib: pip install .[plot])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    tl = report["timeline"]
    ax.plot([p["t"] for p in tl], [p["step"] for p in tl], ".", ms=2, label="step done (rank 0)")
    for i, t in enumerate(report["fault_times"]):
        ax.axvline(t, color="red", lw=1, label="fault" if i == 0 else None)
    for i, t in enumerate(report["restart_times"][1:]):
        ax.axvline(t, color="green", lw=1, ls="--", label="train() re-entered" if i == 0 else None)
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("step")
    ax.set_title(f"goodput {report['totals']['goodput']:.1%}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
