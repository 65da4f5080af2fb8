"""The ``train()`` the framework writes for an unmodified script: run it as ``__main__``, afresh.

Each iteration of the restart loop runs the script from the top, as ``python script.py`` would
(``runpy``: a new ``__main__`` module, so its globals are fresh; every module it imports stays
imported; ``sys.argv`` and the current directory as at launch), with the iteration's torchrun
environment (RANK, WORLD_SIZE, LOCAL_RANK, ... written by the loop;
``TORCHELASTIC_RESTART_COUNT`` here) and the iteration's group answering its own
``init_process_group`` (``inprocess.script_mode.own_group``). The script resumes through its
own logic (its snapshot file). A reserve that takes a lost rank's place runs it from the top as
that rank.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from collections.abc import Mapping

from restartable.inprocess.context import context
from restartable.inprocess.restart import torchrun_env
from restartable.inprocess.restart.loop import restartable
from restartable.inprocess.script_mode.config_env import script_config
from restartable.inprocess.script_mode.leftovers import Leftovers
from restartable.inprocess.script_mode.own_group import iteration_group_answers

log = logging.getLogger(__name__)

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


class WarnOnce:
    """Logs each warning key once per process (a warning repeated every restart is noise)."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def __call__(self, key: str, line: str) -> None:
        if key not in self.said:
            self.said.add(key)
            log.warning("%s", line)


class ScriptRun:
    """One rank's runs of the script at ``path``: ``once()`` is the loop's ``train()``."""

    def __init__(self, path: str, environ: Mapping[str, str]) -> None:
        self.path = path
        # What torchrun's new process would start with again: its arguments and directory.
        self.argv, self.cwd = list(sys.argv), os.getcwd()
        # The launcher's count (its in-job restart round): in-process restarts add to it.
        self.base_count = int(environ.get(RESTART_COUNT, "0") or 0)
        self.warn = WarnOnce()
        self.leftovers = Leftovers(self.warn)

    def once(self) -> None:
        """Run the script once as ``__main__`` (main thread, inside the loop's iteration).

        ``SystemExit`` with status 0 or None is a run that finished; another status leaves
        the job (the loop's rule for ``BaseException``), as the script's exit would.
        """
        iteration = context().iteration
        torchrun_env.export({RESTART_COUNT: str(self.base_count + iteration)})
        self.leftovers.before_run()
        sys.argv = list(self.argv)
        os.chdir(self.cwd)
        try:
            with iteration_group_answers(self.warn):
                runpy.run_path(self.path, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        finally:
            self.leftovers.after_run()


def run_unmodified(path: str) -> None:
    """Run the script at ``path`` under the restart loop until the job ends on this rank."""
    run = ScriptRun(path, os.environ)
    restartable(config=script_config(os.environ))(run.once)()
