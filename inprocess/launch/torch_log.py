"""The launcher's import of torch with torch's C++ warnings off (its own process only).

The launcher hosts the job's store (a libuv TCPStore server). A killed rank's connections end
with a reset, and the server warns on each ("TCPStoreLibUvBackend.cpp ... The remote address
of the client socket cannot be retrieved", "... EBADF"): unprefixed lines on the job's console
after every SIGKILL, about a state the launcher handles. torch reads TORCH_CPP_LOG_LEVEL once,
when it is imported (checked: setting it afterwards changes nothing), so the launcher imports
torch with ERROR unless the user set a level, then removes the variable again: the ranks,
started later with the launcher's environment, keep the user's.
"""

from __future__ import annotations

import importlib
import os

_VAR = "TORCH_CPP_LOG_LEVEL"


def import_torch_quietly() -> None:
    """Import torch with C++ log level ERROR, unless ``TORCH_CPP_LOG_LEVEL`` is set (then as
    set). Call first thing in the launcher's process; a no-op once torch is imported."""
    if os.environ.get(_VAR) is not None:
        importlib.import_module("torch")
        return
    os.environ[_VAR] = "ERROR"
    try:
        importlib.import_module("torch")
    finally:
        del os.environ[_VAR]
