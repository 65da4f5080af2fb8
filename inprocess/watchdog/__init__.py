"""Per-rank watchdog: the rank's side (``owner``) and the watchdog process (``process``, run as
``python -m inprocess.watchdog``). Imports nothing here, so the watchdog process starts lean."""
