"""In-process restart: ``@restartable`` re-runs ``train()`` in the same processes after a fault."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inprocess.config import RestartConfig
    from inprocess.context import RestartContext, RestartRecord, context
    from inprocess.errors import InprocessError, RestartAbortedError
    from inprocess.wrapper import restartable

# Resolved on first use: `python -m inprocess.watchdog` (and the store server) import this
# package without pulling in the restart loop and torch before their module runs.
_EXPORTS = {
    "InprocessError": "inprocess.errors",
    "RestartAbortedError": "inprocess.errors",
    "RestartConfig": "inprocess.config",
    "RestartContext": "inprocess.context",
    "RestartRecord": "inprocess.context",
    "context": "inprocess.context",
    "restartable": "inprocess.wrapper",
}

__all__ = [
    "InprocessError",
    "RestartAbortedError",
    "RestartConfig",
    "RestartContext",
    "RestartRecord",
    "context",
    "restartable",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'inprocess' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
