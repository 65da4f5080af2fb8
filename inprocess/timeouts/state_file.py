"""``ft_state.json``: the computed timeouts a run leaves for the next launch (read, atomic write).

Format (version 1)::

    {"version": 1, "timeouts": {"step": 0.42, "checkpointing": 1.6, "setup": 21.0},
     "safety_factor": 5.0, "written_at": 1763830000.0}

Written by the active rank 0 of the job; read by every rank at launch and at every restart.

An unreadable or corrupt file is never fatal: it is ignored with a WARNING naming the file. So is
one that another user could have written (``checkpoint.private_files.untrusted``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path

from restartable.checkpoint.private_files import replace_private, untrusted
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.timeouts.estimator import KEYS

log = logging.getLogger(__name__)

VERSION = 1


def read_state(path: str | os.PathLike[str]) -> dict[str, float]:
    """The stored timeouts of ``path`` ({} when the file does not exist or cannot be used).

    Only known keys with finite positive values are kept; anything else is reported once per
    call with a WARNING that names the file and what is wrong with it.
    """
    p = Path(path)
    try:
        # Timeouts decide when a rank counts as hung: only a file no other user could have
        # written is believed.
        reason = untrusted(p)
        if reason is not None:
            log.warning(
                "ignoring timeouts state file %s: %s; delete it, or keep it in a directory of "
                "your own",
                p,
                reason,
            )
            return {}
        text = p.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("ignoring timeouts state file %s: cannot read it (%s)", p, exc)
        return {}
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"expected a JSON object with version {VERSION}")
        raw = data.get("timeouts")
        if not isinstance(raw, dict):
            raise ValueError("no 'timeouts' object")
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        log.warning(
            "ignoring timeouts state file %s: not a valid ft_state.json (%s); delete it or let "
            "this run overwrite it",
            p,
            exc,
        )
        return {}
    out: dict[str, float] = {}
    for key, value in raw.items():
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in KEYS and ok and value > 0 and math.isfinite(value):
            out[key] = float(value)
        else:
            log.warning("ignoring %s=%r in timeouts state file %s", key, value, p)
    return out


def write_state(
    path: str | os.PathLike[str],
    timeouts: Mapping[str, float],
    *,
    safety_factor: float,
    clock: Clock = SYSTEM,
) -> None:
    """Replace ``path`` atomically with ``timeouts`` (readers see the old or the new file).

    Written 0600 to a new name in the same directory, flushed to disk, then renamed over the
    target (``checkpoint.private_files.replace_private``): a crash at any moment leaves a whole
    file (or none). Raises ``OSError``.
    """
    p = Path(path)
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    body = json.dumps(
        {
            "version": VERSION,
            "timeouts": {k: round(v, 6) for k, v in sorted(timeouts.items())},
            "safety_factor": safety_factor,
            "written_at": clock.wall(),
        },
        indent=1,
    )
    replace_private(p, body.encode())
