"""``python -m restartable.inprocess.report``: see ``inprocess.report.cli``."""

import sys

from restartable.inprocess.report.cli import main

sys.exit(main())
