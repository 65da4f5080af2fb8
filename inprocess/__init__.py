"""In-process restart: ``@restartable`` re-runs ``train()`` in the same processes after a fault."""
