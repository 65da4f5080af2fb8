"""``DetectorConfig``: the detector's options (the seeds' names and defaults, plus ours)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from restartable.straggler.errors import ConfigError

REFERENCES = ("median", "best")
TIMERS = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class DetectorConfig:
    """What the detector measures, when it reports and what it does about a straggler.

    The first eight fields are NVIDIA's ``NVRxStragglerDetectionConfig`` (same names, same
    defaults). A score is ``reference time / own time`` in (0, 1]; below its threshold the rank
    is a straggler.

    * ``report_time_interval``: seconds between reports (every rank reports at the same step).
    * ``calc_relative_gpu_perf`` / ``calc_individual_gpu_perf``: which scores to compute:
      relative (against the ``relative_to`` rank of this report) and individual (against the
      lower median of the rank's own times in its last ``individual_window`` reports). A
      report's time of a section is the lower quartile of its samples (``scores.QUANTILE``).
    * ``num_gpu_perf_scores_to_print``: how many worst and best ranks the report lists.
    * ``stop_if_detected``: on a straggler every rank sees ``Detector.should_stop`` (checkpoint
      and exit, like a preemption).
    * ``profiling_interval``: time every n-th entry of each section (1: every entry).

    Ours:

    * ``replace_if_detected``: under ``@restartable`` with a warm reserve, a rank flagged in
      ``replace_after_reports`` consecutive reports is demoted to the reserve pool (one
      in-process restart); at most one rank per report, never without a reserve.
    * ``relative_to``: "median" (lower median of the ranks: one fast rank does not make everyone
      a straggler) or "best" (NVRx's reference, the fastest rank).
    * ``gather_timeout``: the most a report waits for the other ranks' numbers; ranks missing
      then are listed as missing (dead, or not calling ``report_if_due`` at the same steps).
    * ``timer``: "cpu" (process CPU time: a rank's own compute, not its wait in a collective),
      "cuda" (CUDA events on the current device), or "auto" (cuda when available, except
      in a process group without NCCL: cpu for a gloo job, whose tensors are on the CPU).
    """

    report_time_interval: float = 300.0
    calc_relative_gpu_perf: bool = True
    calc_individual_gpu_perf: bool = True
    num_gpu_perf_scores_to_print: int = 5
    gpu_relative_perf_threshold: float = 0.7
    gpu_individual_perf_threshold: float = 0.7
    stop_if_detected: bool = False
    profiling_interval: int = 1
    replace_if_detected: bool = False
    replace_after_reports: int = 2
    relative_to: str = "median"
    individual_window: int = 5
    gather_timeout: float = 30.0
    timer: str = "auto"

    def __post_init__(self) -> None:
        for name in ("report_time_interval", "gather_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(
                    f"{name} ({value!r}) must be a finite number of seconds > 0: e.g. {name}=300.0"
                )
        for name in ("gpu_relative_perf_threshold", "gpu_individual_perf_threshold"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value <= 1):
                raise ConfigError(
                    f"{name} ({value!r}) must be in (0, 1] (a score is reference time / own "
                    "time; 0.7 flags a rank about 1.4x slower): e.g. 0.7"
                )
        for name, low in (
            ("profiling_interval", 1),
            ("replace_after_reports", 1),
            ("individual_window", 1),
            ("num_gpu_perf_scores_to_print", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} ({value!r}) must be an integer >= {low}")
        if self.relative_to not in REFERENCES:
            raise ConfigError(
                f"relative_to ({self.relative_to!r}) must be one of {REFERENCES}: 'median' "
                "compares a rank with the typical rank, 'best' with the fastest"
            )
        if self.timer not in TIMERS:
            raise ConfigError(f"timer ({self.timer!r}) must be one of {TIMERS}")
        if not (self.calc_relative_gpu_perf or self.calc_individual_gpu_perf) and (
            self.stop_if_detected or self.replace_if_detected
        ):
            raise ConfigError(
                "stop_if_detected/replace_if_detected need a score: set "
                "calc_relative_gpu_perf or calc_individual_gpu_perf to True"
            )
