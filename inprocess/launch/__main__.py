"""``python -m inprocess.launch``: see ``inprocess.launch.cli``."""

import sys

from inprocess.launch.cli import main

sys.exit(main())
