"""``python -m inprocess.launch``: see ``inprocess.launch.cli``. The flags and the door checks
answer before the launcher's modules import torch (2-6 s): a bad command line is one line at
once."""

import sys

from inprocess.launch.doors import admit

_args = admit()
from inprocess.launch.cli import run  # noqa: E402 (after the door: it imports torch)

sys.exit(run(_args))
