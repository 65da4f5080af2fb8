"""Straggler detection: per-rank performance scores, reports, and stop or replace.

    from straggler import Detector
    det = Detector(context=inprocess.context(), report_time_interval=60.0, replace_if_detected=True)
    with det.section("step"):
        ...
    det.report_if_due(step)

Imports neither ``inprocess`` nor ``checkpoint``: the restart context is used by duck typing.
"""

from straggler.config import DetectorConfig
from straggler.detector import Detector
from straggler.errors import ConfigError, SectionError, StragglerError
from straggler.report import Report

__all__ = ["ConfigError", "Detector", "DetectorConfig", "Report", "SectionError", "StragglerError"]
