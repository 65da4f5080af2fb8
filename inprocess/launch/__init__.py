"""The per-node launcher (``python -m inprocess.launch``): the CLI, the node's supervisor of rank
processes, the job's rounds across launchers, and the exit statuses for autoresume."""
