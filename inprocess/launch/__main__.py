"""``python -m inprocess.launch``: see ``inprocess.launch.cli``."""

import sys

from inprocess.launch.torch_log import import_torch_quietly

import_torch_quietly()  # before anything imports torch: see inprocess/launch/torch_log.py

from inprocess.launch.cli import main  # noqa: E402

sys.exit(main())
