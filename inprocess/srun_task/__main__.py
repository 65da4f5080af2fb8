"""``python -m inprocess.srun_task SCRIPT [ARGS]``: see ``inprocess.srun_task.task``."""

import sys

from inprocess.srun_task.task import main

sys.exit(main())
