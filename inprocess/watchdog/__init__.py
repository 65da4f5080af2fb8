"""The per-rank watchdog process (``process``, run as ``python -m restartable.inprocess.watchdog``):
its decision (``watch``), the rank it watches (``watched_rank``) and the pipe protocol the rank's
side (``inprocess.watchdog_owner``) speaks to it (``pipe``). Imports nothing here, so the
watchdog process starts lean."""
