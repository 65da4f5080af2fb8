"""Per-message statistics of relative differences between a step and its re-run."""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np


class QuickStats:
    """Counts, identical results and a bounded window of differences for percentiles."""

    def __init__(self, max_size: int = 100_000) -> None:
        self.count = 0
        self.identical = 0
        self.max = 0.0
        self._window: collections.deque[float] = collections.deque(maxlen=max_size)

    def add(self, diff: float) -> None:
        self.count += 1
        if diff == 0.0:
            self.identical += 1
        if not math.isnan(diff):
            self.max = max(self.max, diff)
        self._window.append(diff)

    def summary(self) -> dict[str, Any]:
        """``count``, ``identical``, ``avg``, ``p50``, ``p90``, ``p99``, ``max`` (relative)."""
        out: dict[str, Any] = {"count": self.count, "identical": self.identical, "max": self.max}
        if self._window:
            arr = np.asarray(self._window, dtype=np.float64)
            arr = arr[np.isfinite(arr)]
        else:
            arr = np.zeros(0)
        for key, q in (("p50", 50), ("p90", 90), ("p99", 99)):
            out[key] = float(np.percentile(arr, q)) if arr.size else 0.0
        out["avg"] = float(arr.mean()) if arr.size else 0.0
        return out
