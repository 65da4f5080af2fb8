"""``python -m restartable.inprocess.watchdog``: the watchdog process (started by
``watchdog_owner``)."""

import sys

from restartable.inprocess.watchdog.process import main

sys.exit(main(sys.argv[1:]))
