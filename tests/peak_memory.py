"""Peak resident memory of the calling process over one piece of work (Linux /proc).

ru_maxrss is the peak over the process's whole life, so growth measured with it is hidden by
any earlier, higher transient. Writing 5 to /proc/self/clear_refs resets the peak (VmHWM) to
the current resident size instead, so the growth of the work that follows is seen whole.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

AVAILABLE = Path("/proc/self/clear_refs").exists()


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def growth_mib(work: Callable[[], T]) -> tuple[T, float]:
    """Run `work`; return its result and how far the peak resident memory rose above the
    resident size at the start, in MiB."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _vm_hwm()
    result = work()
    return result, (_vm_hwm() - before) / 2**20
