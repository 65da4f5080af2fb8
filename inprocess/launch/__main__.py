"""``python -m restartable.launch``: see ``inprocess.launch.cli``. The flags and the door checks
answer before the launcher's modules import torch (2-6 s): a bad command line is one line at
once."""

import sys

from restartable.inprocess.launch.doors import admit
from restartable.inprocess.launch.torch_log import import_torch_quietly

_args = admit()
import_torch_quietly()  # the first import of torch: see inprocess/launch/torch_log.py
from restartable.inprocess.launch.cli import run  # noqa: E402 (after the door: it imports torch)

sys.exit(run(_args))
