"""Where checkpoints live under the root: step directories, commit markers, listing, retention.

A checkpoint is the directory ``step_<10 digits>-<8 hex>`` (the hex token is fresh per save
attempt, so a retried step never reuses a half-written directory). It is visible only once its
commit marker ``_COMMITTED.json`` (written last) exists and parses. ``_IN_PROGRESS.json`` is
written before any data and proves the directory is ours, so a crashed attempt can be cleaned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import time
import uuid
from typing import Any

from restartable.checkpoint.errors import CheckpointStorageError
from restartable.checkpoint.private_files import NotPrivateError, open_private, private_dir

log = logging.getLogger(__name__)

COMMIT_MARKER = "_COMMITTED.json"
IN_PROGRESS_MARKER = "_IN_PROGRESS.json"
FORMAT = "restartable.checkpoint/1"
_DIR_RE = re.compile(r"^step_(\d{10,19})-([0-9a-f]{8})$")  # 10 digits, more from 10**10 on


@dataclasses.dataclass(frozen=True)
class Committed:
    """One committed checkpoint: its step, directory and the manifest from its commit marker."""

    step: int
    path: str  # directory, in the filesystem's own path form (a URL for remote filesystems)
    manifest: dict[str, Any]

    @property
    def files(self) -> dict[str, dict[str, int]]:
        """File name -> {"crc32": ..., "size": ...} recorded at commit."""
        return dict(self.manifest.get("files", {}))


def dir_name(step: int, token: str) -> str:
    """The directory name of one save attempt of ``step``."""
    return f"step_{step:010d}-{token}"


def parse_dir_name(name: str) -> int | None:
    """The step of a directory name that follows our pattern, else None."""
    m = _DIR_RE.match(name)
    return int(m.group(1)) if m else None


class CheckpointDirs:
    """The checkpoint root on one fsspec filesystem (local paths use the local filesystem).

    Every method is rank-local. Which rank calls what is decided by the callers: rank 0 writes
    markers and applies retention, every rank lists (or receives rank 0's listing).
    """

    def __init__(self, root: str) -> None:
        import fsspec.core
        from fsspec.implementations.local import LocalFileSystem

        self.url = root
        try:
            self.fs, path = fsspec.core.url_to_fs(root)
        except (ValueError, ImportError) as e:
            raise CheckpointStorageError(
                f"root ({root!r}) is not a usable path or fsspec URL ({e}): pass a local path "
                "or a URL whose filesystem is installed (e.g. s3:// needs s3fs)"
            ) from e
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.path = os.path.abspath(path) if self.is_local else path.rstrip("/")

    def join(self, *parts: str) -> str:
        """A path under the root, in the form the filesystem (and DCP's writers) expect."""
        if self.is_local:
            return os.path.join(self.path, *parts)
        return "/".join([self.path, *parts])

    def url_of(self, path: str) -> str:
        """The form DCP's fsspec reader/writer needs (a URL for non-local filesystems)."""
        if self.is_local:
            return path
        return self.fs.unstrip_protocol(path)

    def check_writable(self) -> None:
        """Create the root if needed and prove it writable; CheckpointStorageError otherwise.

        A local root must be private (``private_files.private_dir``): one that another user
        owns or that group or others may write is refused, since whoever can write it can plant
        a checkpoint (and fix up its checksums) or links for our files to follow."""
        if self.is_local:
            try:
                private_dir(self.path, what="checkpoint root")
            except NotPrivateError as e:
                raise CheckpointStorageError(str(e)) from e
            except OSError as e:
                raise CheckpointStorageError(
                    f"checkpoint root ({self.url!r}) is not writable ({type(e).__name__}: {e}): "
                    "pass a directory this process can create files in"
                ) from e
        probe = self.join(f".restartable-probe-{uuid.uuid4().hex[:12]}")
        try:
            self.fs.makedirs(self.path, exist_ok=True)
            self.fs.pipe_file(probe, b"probe")
            self.fs.rm(probe)
        except Exception as e:
            raise CheckpointStorageError(
                f"checkpoint root ({self.url!r}) is not writable ({type(e).__name__}: {e}): "
                "pass a directory this process can create files in"
            ) from e

    # -- markers -------------------------------------------------------------------------------

    def begin(self, dirpath: str, *, step: int, world_size: int) -> None:
        """Create the attempt directory and its in-progress marker (rank 0, before any data)."""
        if self.is_local:  # the checkpoint's files are this user's data
            private_dir(dirpath, what="checkpoint directory")
        else:
            self.fs.makedirs(dirpath, exist_ok=True)
        body = {"format": FORMAT, "step": step, "world_size": world_size, "started": time.time()}
        self.write_small(self.join_dir(dirpath, IN_PROGRESS_MARKER), body)

    def commit(self, dirpath: str, manifest: dict[str, Any]) -> None:
        """Write the commit marker: the single point at which the checkpoint becomes visible.

        Local files: temporary file, fsync, atomic rename, directory fsync. Other filesystems:
        one whole-object write (an object store never shows a partial object); a torn marker on
        any filesystem fails to parse and counts as "not committed".
        """
        self.write_small(self.join_dir(dirpath, COMMIT_MARKER), {"format": FORMAT, **manifest})

    def join_dir(self, dirpath: str, name: str) -> str:
        return os.path.join(dirpath, name) if self.is_local else f"{dirpath}/{name}"

    def write_small(self, path: str, body: dict[str, Any]) -> None:
        data = json.dumps(body, sort_keys=True).encode()
        if not self.is_local:
            self.fs.pipe_file(path, data)
            return
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        fd = open_private(tmp, os.O_WRONLY, exclusive=True)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))

    # -- listing -------------------------------------------------------------------------------

    def _our_dirs(self) -> list[tuple[int, str]]:
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for entry in entries:
            name = str(entry).rstrip("/").rsplit("/", 1)[-1]
            step = parse_dir_name(name)
            if step is not None:
                out.append((step, self.join(name)))
        return sorted(out)

    def read_manifest(self, dirpath: str) -> dict[str, Any] | None:
        """The parsed commit marker of ``dirpath``, or None if it is absent or torn."""
        try:
            raw = self.fs.cat_file(self.join_dir(dirpath, COMMIT_MARKER))
            body = json.loads(raw)
        except (FileNotFoundError, ValueError, OSError):
            return None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            return None
        return body

    def list_committed(self) -> list[Committed]:
        """Committed checkpoints, oldest first (by step, then commit time)."""
        found = []
        for step, path in self._our_dirs():
            manifest = self.read_manifest(path)
            if manifest is not None and manifest.get("step") == step:
                found.append(Committed(step=step, path=path, manifest=manifest))
        found.sort(key=lambda c: (c.step, float(c.manifest.get("committed", 0.0))))
        return found

    # -- retention -----------------------------------------------------------------------------

    def apply_retention(self, keep: int, *, protect: str | None = None) -> list[str]:
        """Delete committed checkpoints beyond the newest ``keep``, and stale partial attempts.

        Called by rank 0 only after a newer checkpoint is committed. Never deletes the newest
        committed checkpoint (``keep >= 1``), nor a directory that does not match our naming
        pattern, nor a partial one that is newer than the newest commit or lacks our
        in-progress marker. Deleting removes the commit marker first, so a crash half-way
        leaves an uncommitted (invisible) directory, never a torn visible checkpoint.
        """
        assert keep >= 1, keep
        committed = self.list_committed()
        doomed = [c.path for c in committed[:-keep]]
        newest = committed[-1].step if committed else None
        visible = {c.path for c in committed}
        if newest is not None:
            for step, path in self._our_dirs():
                if path in visible or path == protect or step > newest:
                    continue
                if self.fs.exists(self.join_dir(path, IN_PROGRESS_MARKER)):
                    doomed.append(path)
        for path in doomed:
            self.remove(path)
        return doomed

    def remove(self, dirpath: str) -> None:
        """Delete one of our directories, commit marker first."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.join_dir(dirpath, COMMIT_MARKER))
        if self.is_local:
            fsync_dir(dirpath)
        self.fs.rm(dirpath, recursive=True)
        log.info("checkpoint: deleted %s", dirpath)


def fsync_dir(path: str) -> None:
    """fsync a local directory so a rename or unlink inside it is durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
