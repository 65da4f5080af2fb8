"""``python -m inprocess.watchdog``: the watchdog process (started by ``watchdog_owner``)."""

import sys

from inprocess.watchdog.process import main

sys.exit(main(sys.argv[1:]))
