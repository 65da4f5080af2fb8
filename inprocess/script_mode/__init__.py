"""Run a rank's script: an unmodified torchrun script under the restart loop, in place; a script
that uses ``@restartable`` as it is (``inprocess.script_mode.entry.run_script``)."""
