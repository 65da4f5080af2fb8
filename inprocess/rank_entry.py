"""A rank's first code: take the job's secret out of the environment, then run the user's script.

``python -m restartable.inprocess.rank_entry script.py args...`` is how ``inprocess.launch`` starts
a rank cold (the warm pool's fork does the same in ``inprocess.forkserver``): the secret
(``RESTARTABLE_SECRET``) moves into ``checkpoint.sealing`` before one line of the script runs,
so no process the script starts (``subprocess``, ``os.system``) inherits it. The script then
runs as ``python script.py args...`` would run it: ``__main__``, its own ``sys.argv`` and its
directory first on ``sys.path``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from restartable.checkpoint import sealing
from restartable.inprocess.script_mode.entry import run_script


def main(argv: Sequence[str]) -> None:
    """Run ``argv[0]`` (a script path) with ``argv`` as its ``sys.argv``; its exit is ours."""
    if not argv:
        raise SystemExit("usage: python -m restartable.inprocess.rank_entry SCRIPT [ARGS...]")
    sealing.take_from_environ()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py`
    run_script(argv[0])


if __name__ == "__main__":
    main(sys.argv[1:])
