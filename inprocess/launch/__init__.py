"""The per-node launcher (``python -m restartable.launch``): the CLI, the node's supervisor of rank
processes, the job's rounds across launchers, and the exit statuses for autoresume."""
