"""The offline report of a run's journal: downtime terms, fault attribution, the CLI.

``python -m restartable.inprocess.report`` runs ``cli.main``; the example imports ``reports``,
``format_report`` and ``plot`` from here.
"""

from restartable.inprocess.report.cli import format_report, plot, reports

__all__ = ["format_report", "plot", "reports"]
