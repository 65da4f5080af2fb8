"""``python -m restartable.inprocess.report JOURNAL_DIR [--json OUT] [--png OUT]`` and ``--attribute
DIR...``.

The downtime report of every launch recorded in a journal directory (terms defined in
``inprocess.report.downtime``; with several launches, e.g. a requeued job's attempts, also the
job view over them, ``inprocess.report.job_view``), and the attribution of faults across one or
several directories (``inprocess.report.attribution``). Reads only the journal files; needs no
torch.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from restartable.inprocess import journal
from restartable.inprocess.report import attribution, downtime, job_view, terms
from restartable.inprocess.usage import UsageParser

EXIT_NO_PLOT = 3  # --png without matplotlib: the text and the JSON were written, the PNG not


def reports(directory: str | Path) -> list[terms.LaunchReport]:
    """The report of each launch in ``directory``'s journal, oldest first."""
    records = journal.read(directory)
    if not records:
        raise ValueError(f"no journal records under {str(directory)!r}")
    out = [downtime.build(recs, launch) for launch, recs in downtime.launches(records).items()]
    return sorted(out, key=lambda r: r.start)


def format_report(r: terms.LaunchReport) -> str:
    """The report as text: every figure with its unit, one quantity per column.

    One row per fault window (see ``inprocess.report.downtime`` for each term's definition;
    ``level``
    says who recovered: the in-process restart, or ``inprocess.launch`` restarting every rank);
    the terms of a row add up to its ``downtime [s]``. Then one row per respawned process
    (outside the downtime sum: the ranks that train go on meanwhile).
    """
    title = f"launch {r.launch}" if r.launch else "downtime report"
    reached = {
        "ping": f"highest step reached {r.steps}",
        "saves": f"highest step saved {r.steps} (no ctx.ping: progress from checkpoint saves)",
        "probe": "steps unknown (no ctx.ping, no checkpoint save: progress from the progress "
        "probe; redo not measured)",
    }[r.progress_source]
    lines = [
        f"{title}: wall {r.wall:.2f} s = startup {r.startup:.2f} s + productive "
        f"{r.productive:.2f} s + downtime {r.downtime:.2f} s; goodput {100 * r.goodput:.1f} %",
        f"  {reached}, restarts {r.restarts}, checkpoint stalls outside "
        f"fault windows {r.checkpoint:.3f} s",
    ]
    if r.respawns or r.in_job_restarts:  # only in a journal the launcher wrote to as well
        lines.append(f"  respawned processes {r.respawns}, in-job restarts {r.in_job_restarts}")
    if r.windows:
        lines += _window_rows(r.windows)
    if r.respawn_windows:
        lines += _respawn_rows(r.respawn_windows)
    return "\n".join(lines)


def _window_rows(windows: list[terms.Window]) -> list[str]:
    lines = [
        f"  {'injected fault':24} {'level':10} {'it':>3} {'cause':14} {'rank':>5} "
        f"{'initial rank':>12} "
        f"{'lost-before [s]':>15} {'detect [s]':>10} {'restart [s]':>11} {'reload [s]':>10} "
        f"{'redo [s]':>8} {'downtime [s]':>12}  {'tier':9} {'from step':>9} "
        f"{'back at step':>12}  restored from"
    ]
    for w in windows:
        t = w.terms
        trained, initial = _ranks(w)
        from_step = "-" if w.restored_step is None else str(w.restored_step)
        lines.append(
            f"  {w.fault or '-':24} {w.level:10} {w.iteration:3d} {w.kind:14} {trained:>5} "
            f"{initial:>12} "
            f"{t['lost_before']:15.3f} {t['detection']:10.3f} {t['restart']:11.3f} "
            f"{t['reload']:10.3f} {t['redo']:8.3f} {t['downtime']:12.3f}  "
            f"{w.tier or '-':9} {from_step:>9} {w.reached_step:>12}  {w.tiers or '-'}"
        )
    return [
        *lines,
        "  (level: in-process restart, or in-job (the launcher restarted every rank); it: the "
        "iteration that faulted; rank: the blamed rank as the fault plan and ctx.rank name it; "
        "initial rank: its RANK at launch, as the restart's cause names it;",
        "   tier: rank 0's restore; restored from: every active rank's; from step: the checkpoint "
        "restored; back at step: the step reached before the fault, reached again where the "
        "window ends; each row's terms add up to its downtime)",
    ]


def _ranks(w: terms.Window) -> tuple[str, str]:
    """The blamed ranks as the fault plan and ``ctx.rank`` name them ("-" where unknown: an
    in-job restart), and their RANK at launch (what the restart's cause and logs say)."""
    trained = []
    for i in range(len(w.faulting_ranks)):
        r = w.training_ranks[i] if i < len(w.training_ranks) else None
        trained.append("-" if r is None else str(r))
    return ",".join(trained) or "-", ",".join(map(str, w.faulting_ranks)) or "-"


def _respawn_rows(windows: list[terms.RespawnWindow]) -> list[str]:
    def cell(value: float | None, width: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:{width}.3f}"

    lines = [
        "  respawns (outside the downtime sum: the others trained on; the pool was short by one)",
        f"  {'injected fault':24} {'slot rank':>9} {'identity':>8} {'new':>4} {'how':24} "
        f"{'detect [s]':>10} {'start [s]':>9} {'join [s]':>8} {'recovery [s]':>12}",
    ]
    for w in windows:
        t = w.terms
        new = "-" if w.new_identity is None else str(w.new_identity)
        lines.append(
            f"  {w.fault or '-':24} {w.slot_rank:9d} {w.identity:8d} {new:>4} {w.how:24} "
            f"{cell(t['detection'], 10)} {cell(t['start'], 9)} {cell(t['join'], 8)} "
            f"{cell(t['recovery'], 12)}"
        )
    lines.append(
        "   (detect: death -> the launcher saw it; start: -> the new process started; join: -> "
        "it registered as a ready reserve; recovery: detect end -> ready)"
    )
    return lines


class PlotUnavailable(RuntimeError):
    """``plot`` needs matplotlib, which is not installed; the message names the extra."""


def plot(reps: list[terms.LaunchReport], records: list[dict[str, Any]], out: Path) -> None:
    """A timeline PNG: rank 0's progress over time, each fault window shaded, checkpoints marked.

    Raises ``PlotUnavailable`` (nothing written) without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable(
            f"the timeline needs matplotlib ({e}): install the extra, pip install "
            "'restartable[plot]' (or pip install matplotlib)"
        ) from e
    t0 = min(r.start for r in reps)
    fig, ax = plt.subplots(figsize=(10, 4))
    rank0 = [(t - t0, s) for rep in reps for t, s in rep.progress]
    ax.plot([t for t, _ in rank0], [s for _, s in rank0], ".", ms=2, label="step (rank 0)")
    for rep in reps:
        for w in rep.windows:
            ax.axvspan(w.last - t0, w.back - t0, color="tab:red", alpha=0.25)
            label = f" {w.fault or w.kind}"
            ax.text(w.last - t0, 0, label, rotation=90, va="bottom", fontsize=7)
    saves = [float(r["t"]) - t0 for r in records if r["event"] == "save_durable"]
    for t in saves:
        ax.axvline(t, color="tab:green", lw=0.5, alpha=0.5)
    ax.set_xlabel("time since the first launch started [s]")
    ax.set_ylabel("step")
    ax.set_title("training progress; red: fault windows, green: durable checkpoints")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = UsageParser(
        prog="python -m restartable.inprocess.report",
        description="Downtime report and fault attribution from restartable's run journal.",
    )
    p.add_argument("dirs", nargs="+", type=Path, help="journal director(y/ies)")
    p.add_argument("--json", type=Path, help="also write the report as JSON here")
    p.add_argument("--png", type=Path, help="also draw the timeline here (needs matplotlib)")
    p.add_argument(
        "--attribute", action="store_true", help="classify every fault across all the dirs"
    )
    args = p.parse_args(argv)
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        p.error(f"not a directory: {', '.join(missing)}")
    out: dict[str, Any] = {}
    try:
        if args.attribute:
            records = [r for d in args.dirs for r in journal.read(d)]
            findings = attribution.analyse(records)
            out["attribution"] = [f.as_dict() for f in findings]
            for f in findings:
                print(f.line())
        else:
            if len(args.dirs) != 1:
                p.error("a report reads one journal directory (several only with --attribute)")
            reps = reports(args.dirs[0])
            out["launches"] = [r.as_dict() for r in reps]
            print("\n".join(format_report(r) for r in reps))
            if len(reps) > 1:  # several attempts (a requeued job): the job over all of them
                view = job_view.build(reps)
                out["job"] = view.as_dict()
                print(job_view.format_view(view))
    except ValueError as e:
        print(f"restartable.inprocess.report: error: {e}", file=sys.stderr)
        return 2
    if args.json:  # before the picture: a missing plotting library costs the PNG alone
        args.json.write_text(json.dumps(out, indent=2))
    if args.png and not args.attribute:
        try:
            plot(reps, journal.read(args.dirs[0]), args.png)
        except PlotUnavailable as e:
            written = f"; {args.json} was written" if args.json else ""
            print(f"restartable.inprocess.report: --png: {e}{written}", file=sys.stderr)
            return EXIT_NO_PLOT
    return 0
