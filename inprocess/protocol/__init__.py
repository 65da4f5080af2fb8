"""What ranks, watchdogs and launchers agree on through the coordination store: keys, the restart
decision, rank assignment, job-level keys, the launcher's environment. Pure or store-only: no
torch import."""
