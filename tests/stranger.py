"""A real second local user for the tests of what another user on the host can plant.

``stranger()`` returns the (uid, gid) of the user ``restartable-stranger``, creating it with
``useradd`` when it does not exist; it skips the calling test unless the tests run as root (only
root can create a user and hand it a directory). ``stranger_dir()`` makes a directory under
/tmp that the stranger owns (mode 0755: everyone may traverse it, only the stranger write it);
``as_stranger`` runs a command as that user, so what it plants is planted by them.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import tempfile
from pathlib import Path

import pytest

NAME = "restartable-stranger"


def stranger() -> tuple[int, int]:
    """(uid, gid) of the second user; skips the test when it cannot exist."""
    if os.getuid() != 0:
        pytest.skip("creating a second local user and giving it a directory needs root")
    try:
        entry = pwd.getpwnam(NAME)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME],
            capture_output=True,
            text=True,
            check=False,
        )
        try:  # another test process may have created it at the same moment
            entry = pwd.getpwnam(NAME)
        except KeyError:
            pytest.skip(f"useradd {NAME} failed: {made.stderr.strip()}")
    return entry.pw_uid, entry.pw_gid


def stranger_dir(prefix: str) -> Path:
    """A new directory under /tmp that the stranger owns, mode 0755 (the caller removes it)."""
    uid, gid = stranger()
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chown(path, uid, gid)
    path.chmod(0o755)
    return path


def as_stranger(*argv: str) -> None:
    """Run ``argv`` as the stranger; raises if it fails."""
    uid, gid = stranger()
    subprocess.run(list(argv), user=uid, group=gid, extra_groups=[], check=True, timeout=30)
