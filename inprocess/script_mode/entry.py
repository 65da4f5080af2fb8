"""A rank's script, run: the one call ``inprocess.rank_entry`` and the fork server make."""

from __future__ import annotations

import os
import runpy

from restartable.inprocess.script_mode.detect import restart_in_place


def run_script(path: str) -> None:
    """Run ``path`` as ``__main__``: under the restart loop, re-run in place after a fault, when
    it does not drive the loop itself (``inprocess.script_mode.detect``); else as it is."""
    if restart_in_place(path, os.environ):
        from restartable.inprocess.script_mode.runner import run_unmodified  # imports torch

        run_unmodified(path)
    else:
        runpy.run_path(path, run_name="__main__")
