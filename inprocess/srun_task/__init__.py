"""The srun task, a process of its own (``python -m restartable.inprocess.srun_task SCRIPT
[ARGS]``): it runs one rank (or one node's launcher) as its child and exits with the job's outcome
(``task``)."""
