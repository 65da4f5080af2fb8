"""Straggler detection: per-rank performance scores, reports, and stop or replace.

    from restartable.straggler import Detector
    det = Detector(context=inprocess.context(), report_time_interval=60.0, replace_if_detected=True)
    with det.section("step"):
        ...
    det.report_if_due(step)

Imports neither ``inprocess`` nor ``checkpoint``: the restart context is used by duck typing.
"""

from restartable.straggler.config import DetectorConfig
from restartable.straggler.detector import Detector
from restartable.straggler.errors import ConfigError, SectionError, StragglerError
from restartable.straggler.report import Report

if __name__ != "restartable.straggler":  # the source tree's folder, imported by its old name
    raise ImportError(
        f"{__name__!r} is restartable's straggler/ folder imported by its old name: "
        "import restartable.straggler instead (python -m restartable.launch for the launcher)"
    )

__all__ = ["ConfigError", "Detector", "DetectorConfig", "Report", "SectionError", "StragglerError"]
