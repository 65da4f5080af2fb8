"""``python -m restartable.inprocess.forkserver --socket PATH --launcher-pid PID --preload M,...``:
started by ``inprocess.launch.pool.WarmPool.start()`` only (``inprocess.forkserver.server``)."""

import sys

from restartable.inprocess.forkserver.server import main

sys.exit(main(sys.argv[1:]))
