"""``python -m inprocess.report``: see ``inprocess.report.cli``."""

import sys

from inprocess.report.cli import main

sys.exit(main())
