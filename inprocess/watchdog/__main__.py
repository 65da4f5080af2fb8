"""``python -m inprocess.watchdog``: the watchdog process's entry point (started by ``owner``)."""

import sys

from inprocess.watchdog.process import main

sys.exit(main(sys.argv[1:]))
