"""The warm pool's fork server, a process of its own (``python -m
restartable.inprocess.forkserver``): it imports torch once and forks each rank the launcher asks for
(``server``), over the wire that ``wire`` defines and ``inprocess.launch.pool`` speaks from the
launcher's side."""
