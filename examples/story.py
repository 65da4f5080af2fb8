"""The example's logging: the story on the console, every detail in a file per rank.

Console: the example's own lines (progress, restarts, resume), each injected fault, and errors
as one line (no traceback). File ``RUN_DIR/logs/<launch>/rank<N>.log``: every INFO record of every
package, tracebacks included. ``--debug`` puts everything on the console too.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

# Loggers whose INFO records belong to the story (the rest is detail).
_STORY = ("train", "restartable.inprocess.faults")


class _Story(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.name.startswith(_STORY)


class _OneLine(logging.Formatter):
    """An error's exception as ``Type: message`` on the same line, not a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            text += f" ({type(exc).__name__}: {exc})"
        return text


def configure(log_dir: Path, *, rank: int, debug: bool) -> Path:
    """Install the two handlers on the root logger; returns the rank's log file."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank{rank}.log"
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    detail = logging.FileHandler(path)
    detail.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(detail)
    console = logging.StreamHandler(sys.stdout)
    if debug:
        console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    else:
        console.addFilter(_Story())
        console.setFormatter(_OneLine())
    root.addHandler(console)
    return path
