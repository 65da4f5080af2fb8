"""``python -m restartable.inprocess.srun_task SCRIPT [ARGS]``: see ``inprocess.srun_task.task``."""

import sys

from restartable.inprocess.srun_task.task import main

sys.exit(main())
