"""In-process restart: ``@restartable`` re-runs ``train()`` in the same processes after a fault."""

from inprocess.config import RestartConfig
from inprocess.context import RestartContext, RestartRecord, context
from inprocess.errors import InprocessError, RestartAbortedError
from inprocess.wrapper import restartable

__all__ = [
    "InprocessError",
    "RestartAbortedError",
    "RestartConfig",
    "RestartContext",
    "RestartRecord",
    "context",
    "restartable",
]
