"""Directories and files private to the user: refused when another user could plant in them,
created without following links.

The rule for every directory the framework writes into (the checkpoint root, the local tier's
``local_dir``, the journal directory, the watchdogs' log directory, a run's fault records): it
belongs to this user and neither group nor others may write it. Only then can nobody else have
planted a file or a symbolic link in it, and only then is opening a name inside it safe. Files
are opened with ``O_NOFOLLOW`` besides (a link in a private directory is this user's own
mistake, not an attack, but it is still refused) and created 0600.

Public API of every process of a job (launcher, ranks, watchdogs, the fault drill, the journal):
stdlib only, no torch import. It lives in ``checkpoint``, the lower layer that ``inprocess``
depends on; the names in ``__all__`` are the contract. docs/security.md ("Files and
checkpoints") says which directories follow the rule.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

__all__ = ["NotPrivateError", "open_private", "private_dir", "replace_private", "untrusted"]

_NEW_FILE = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class NotPrivateError(PermissionError):
    """A directory or file another user owns or may write; the message names it and the fix."""


def private_dir(path: str | os.PathLike[str], *, what: str) -> Path:
    """Create ``path`` (and the missing parents, all 0700) or accept an existing one, and
    check that it is private: this user's, not writable by group or others, and not a symbolic
    link that another user made. ``what`` names the setting in the message (``"journal_dir"``).

    Returns ``path``. Raises ``NotPrivateError`` (a ``PermissionError``) naming ``path``, or the
    ``OSError`` of a failed ``mkdir`` (``NotADirectoryError`` for a file in its place).
    """
    p = Path(path)
    missing = [d for d in (p, *p.parents) if not os.path.lexists(d)]
    for d in reversed(missing):  # the new parents too: 0700, not the umask's 0755
        with contextlib.suppress(FileExistsError):  # made meanwhile by another rank
            d.mkdir(mode=0o700)  # mkdir never follows a link at the last name
    me = os.getuid()
    link = os.lstat(p)
    if stat.S_ISLNK(link.st_mode) and link.st_uid != me:
        raise NotPrivateError(
            f"{what} ({str(p)!r}) is a symbolic link that uid {link.st_uid} made, not this user "
            f"({me}): it could point anywhere; use a directory of your own (mode 0700)"
        )
    st = os.stat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(p))
    if st.st_uid != me:
        raise NotPrivateError(
            f"{what} ({str(p)!r}) belongs to uid {st.st_uid}, not to this user ({me}): another "
            "user could plant files or links in it; use a directory of your own (mode 0700)"
        )
    if st.st_mode & 0o022:
        raise NotPrivateError(
            f"{what} ({str(p)!r}) has mode {stat.S_IMODE(st.st_mode):o}: group or others may "
            f"write it and plant files or links; run chmod go-w {str(p)!r} or use a directory "
            "of your own (mode 0700)"
        )
    return p


def open_private(path: str | os.PathLike[str], flags: int, *, exclusive: bool) -> int:
    """``os.open`` of ``path`` for writing, created 0600, never through a symbolic link
    (``O_NOFOLLOW``; ``exclusive`` adds ``O_EXCL``, for names that must be new). An existing
    file must be a regular file of this user. Returns the descriptor; the caller closes it.

    Raises ``NotPrivateError`` naming ``path`` for a link or a foreign file, ``FileExistsError``
    when ``exclusive`` and it exists.
    """
    try:
        fd = os.open(path, flags | _NEW_FILE | (os.O_EXCL if exclusive else 0), 0o600)
    except OSError as e:
        if os.path.islink(path):  # ELOOP from O_NOFOLLOW (or EEXIST with O_EXCL)
            raise NotPrivateError(
                f"{os.fspath(path)!r} is a symbolic link: refused to write through it; delete "
                "it (someone else may have planted it)"
            ) from e
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise NotPrivateError(
            f"{os.fspath(path)!r} is not a regular file of this user (uid {st.st_uid}): "
            "refused to write it; delete it"
        )
    return fd


def replace_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` atomically with ``data``, 0600: written to a new temporary name beside
    it (``open_private`` with ``O_EXCL``, so never through a planted link), fsynced, renamed
    over ``path``. A reader sees the old file or the new one. Raises ``OSError``."""
    p = os.fspath(path)
    tmp = (
        f"{os.path.join(os.path.dirname(p), '.' + os.path.basename(p))}.{secrets.token_hex(4)}.tmp"
    )
    fd = open_private(tmp, os.O_WRONLY, exclusive=True)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def untrusted(path: str | os.PathLike[str]) -> str | None:
    """Why another user could have written the existing file ``path`` (a link, another owner,
    writable by group or others, or in a directory they may write without the sticky bit), or
    None when only this user (or root) could have. For files read back as settings."""
    p = Path(path)
    st = os.lstat(p)
    me = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if st.st_uid != me:
        return f"it belongs to uid {st.st_uid}, not to this user ({me})"
    if st.st_mode & 0o022:
        return f"group or others may write it (mode {stat.S_IMODE(st.st_mode):o})"
    parent = os.stat(p.parent)
    if parent.st_uid not in (me, 0):
        return f"its directory belongs to uid {parent.st_uid}"
    if parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX:
        return f"group or others may write its directory (mode {stat.S_IMODE(parent.st_mode):o})"
    return None
