"""Whether a script drives the restart loop itself (it names ``restartable``: the decorator or
the package every import of ours goes through).

Torch-free and cheap: read once per rank process, before the script runs. Such a script runs as
it is (its own loop; never wrapped twice); any other script that ``inprocess.launch`` started
runs under the loop that ``inprocess.script_mode.runner`` writes for it (a fork server used
without the launcher runs scripts as they are). ``INPROCESS_RESTART_IN_PLACE=0`` turns the
wrapping off for a script the text does not reveal (it reaches ``@restartable`` through a module
of its own).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

OPT_OUT_ENV = "INPROCESS_RESTART_IN_PLACE"
LAUNCHER_ENV = "INPROCESS_LAUNCH_ROUND"  # set by inprocess.launch.rank_env only

# The decorator's name, or the import root every import of ours goes through (the Lightning
# plugin, context()): ``restartable.inprocess`` and the like. A user's own ``inprocess.py`` or
# ``checkpoint.py`` imported by an unmodified script says nothing about us.
_USES = re.compile(rb"\brestartable\b")


def uses_restartable(path: str) -> bool:
    """True when the script at ``path`` names ``restartable``.

    An unreadable path is False: running it reports the error as ``python script.py`` would.
    """
    try:
        source = Path(path).read_bytes()
    except OSError:
        return False
    return _USES.search(source) is not None


def restart_in_place(path: str, environ: Mapping[str, str]) -> bool:
    """Whether the script at ``path`` runs under the restart loop the framework writes: a rank
    that ``inprocess.launch`` started (its store hosts the loop's keys), not opted out."""
    if LAUNCHER_ENV not in environ:
        return False
    if environ.get(OPT_OUT_ENV, "1").strip() in ("0", "false", "no", "off"):
        return False
    return not uses_restartable(path)
