"""The project's command lines: argparse without abbreviations, and a usage error in one line.

argparse's defaults turned a typo into another flag (``--fault demo`` was taken as ``--faults``)
and buried the error under the whole usage block (19 lines for the launcher).
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

EXIT_USAGE = 2  # argparse's status for a bad command line; the launcher's for any bad setting


class UsageParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``allow_abbrev=False`` whose ``error`` prints one line,
    ``PROG: error: MESSAGE (--help lists the flags)``, and exits with ``EXIT_USAGE``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (--help lists the flags)\n")
