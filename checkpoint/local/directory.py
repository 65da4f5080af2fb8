"""Node-local directory of the local tier: one file per shard copy, rewritten in place.

Layout. Each process writes files of its own, ``<local_dir>/shard-<pid>-<tag>-<n>.bin``, and no
other process writes them, so co-located ranks share the directory without coordinating. A file
holds one shard at a time: a 64-byte record at offset 0 (magic, checksum algorithm, step, owner,
world size, bytes, the shard's checksum, and the record's own checksum, so that a torn record is
no record), then the packed shard from DATA_OFFSET (page-aligned). A file is reused for a later
step once its step is pruned: pruning clears its record, and a save writes the data first and
the record last. A process killed between the two leaves a file without a record, which is
ignored; a reader racing a rewrite finds a checksum that does not match and takes the next copy.
So no reader ever takes a half-written shard, and a save costs two ``pwrite`` calls into pages
already in the page cache, plus one more to clear the pruned step's record. The previous layout
(a directory per step, data and a .json renamed into place, the pruned directory removed) cost
about 1.5 ms of CPU per save of the example's state, half of it file-system metadata
(docs/performance.md, issue 34).

Files of processes that are gone. A writer holds an exclusive ``flock`` on each of its files for
as long as it has them open, which ends with the process however it ends. ``sweep`` removes the
files no live process holds whose step is no longer kept; until then a dead process's files are
there for its replacement to restore from.

No fsync. This copy exists for the loss of a *process* (killed, crashed, replaced by a reserve on
the same node): what it wrote is in the kernel's page cache, which outlives the process and is
what any other process reads. The loss of the *node* is the persistent tier's (fsynced) and the
peers' replicas' job. After a power loss a file here may be short or stale; its checksum then
fails and the restore moves on to the next copy. An fsync per step cost more than the step
itself on this project's machine (7-15 ms median per save of the example's 1.6 MB state, against
1.5-3 ms without: the training thread waited for the previous step's fsync).

Why a ``pwrite`` from the background thread, and neither of the two writes that look cheaper
(``python benchmarks/local_dir_write.py --dir D``: 1.6 MB, thread CPU per save with 10 ms pauses
between saves, this project's VM, ext4 and tmpfs; ``benchmarks/step_overhead.py --local-dir``):
- ``O_DIRECT`` saves no CPU (0.27-0.31 ms against 0.29-0.32 ms on ext4), takes 1.2-1.3 ms of
  wall time, writes the device at every save, and makes a restore read the device instead of
  the page cache.
- Save buffers mapped from these files (``MAP_SHARED``) would make the training thread's copy
  also the file's copy and drop the ``pwrite``. On a disk-backed file system the kernel's
  writeback then write-protects the pages, and the next copy faults on every page, on the
  training thread: 1.39-1.45 ms instead of 0.29-0.33 ms. On tmpfs a copy in a loop costs the
  same either way (0.29-0.32 ms), and mapped buffers took 0.22-0.34 ms per step off this
  thread; but in the 2-rank step benchmark the training threads then took 0.8-2.7 ms more CPU
  per step over plain DDP's than with ``pwrite`` (3 pairs of runs): more than they saved. Not
  understood yet; the code is commit 613100b (reverted).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from restartable.checkpoint.errors import CheckpointError, CheckpointStorageError
from restartable.checkpoint.local import fence, integrity, packing, parts
from restartable.checkpoint.private_files import NotPrivateError, open_private, private_dir

_FILE = re.compile(r"^shard-\d+-[0-9a-f]{8}-\d+\.bin$")
_PROBE = ".restartable-probe"
_MIN_FREE = 16 << 20  # a directory with less free space than this cannot hold any useful shard
_MAGIC = b"RSTSHARD"
# magic, checksum algorithm (NUL-padded), step, owner, world, nbytes, shard checksum; then the
# record's own checksum (8 bytes).
_RECORD = struct.Struct("<8s8sqqqqq")
RECORD_SIZE = _RECORD.size + 8
DATA_OFFSET = 4096  # the shard starts on a page boundary


@dataclass(frozen=True)
class ShardMeta:
    """What is known about a shard before reading it; `path`: the file holding it (scan)."""

    step: int
    owner: int
    world: int
    nbytes: int
    checksum: int  # checkpoint.local.integrity of the packed bytes
    path: str = field(default="", compare=False)


def validate(local_dir: str | os.PathLike[str]) -> Path:
    """Construction-time check: the directory exists (created, private to the user, like the
    persistent root), is writable and not nearly full."""
    path = Path(local_dir)
    try:
        # Another user's directory (or one others may write) could hold links or shards they
        # planted, or let them read this job's state: refused.
        private_dir(path, what="local_dir")
    except NotPrivateError as e:
        raise CheckpointStorageError(str(e)) from e
    except OSError as e:
        raise CheckpointStorageError(
            f"local_dir ({local_dir!r}) is not a directory and cannot be created "
            f"({e.strerror}): choose a directory on node-local NVMe or /dev/shm, or pass "
            "local_dir=None for memory only"
        ) from e
    probe = path / f"{_PROBE}.{os.getpid()}"
    try:
        os.close(open_private(probe, os.O_WRONLY, exclusive=True))
        probe.unlink()
    except OSError as e:
        raise CheckpointStorageError(
            f"local_dir ({local_dir!r}) is not writable ({e.strerror}): fix its permissions or "
            "choose another directory"
        ) from e
    free = shutil.disk_usage(path).free
    if free < _MIN_FREE:
        raise CheckpointStorageError(
            f"local_dir ({local_dir!r}) has {free} bytes free, less than {_MIN_FREE}: free space "
            "or choose a larger directory"
        )
    return path


def check_capacity(path: Path, needed: int, used: int) -> None:
    """First-save check, once the shard size is known: the kept steps must fit."""
    free = shutil.disk_usage(path).free + used
    if free < needed:
        raise CheckpointStorageError(
            f"local_dir ({str(path)!r}) is too small: {needed} bytes needed for the kept local "
            f"steps and replicas, {free} available: lower keep or replication_factor, or choose "
            "a larger directory"
        )


def encode_record(meta: ShardMeta, algo: str = integrity.ALGORITHM) -> bytes:
    """The RECORD_SIZE bytes that mark a file as holding `meta`'s shard."""
    body = _RECORD.pack(
        _MAGIC, algo.encode(), meta.step, meta.owner, meta.world, meta.nbytes, meta.checksum
    )
    return body + integrity.of_bytes(body).to_bytes(8, "little", signed=True)


def decode_record(raw: bytes, path: str = "") -> ShardMeta | None:
    """The shard a record describes; None for no record (cleared, torn, foreign) or one whose
    checksum algorithm is not this version's (its shard cannot be verified)."""
    if len(raw) < RECORD_SIZE:
        return None
    body = raw[: _RECORD.size]
    if integrity.of_bytes(body).to_bytes(8, "little", signed=True) != raw[_RECORD.size :]:
        return None
    magic, algo, step, owner, world, nbytes, checksum = _RECORD.unpack(body)
    if magic != _MAGIC or algo.rstrip(b"\0") != integrity.ALGORITHM.encode():
        return None
    return ShardMeta(step, owner, world, nbytes, checksum, path)


class _File:
    """One file of this process: open read-write, under its exclusive flock, for its life."""

    def __init__(self, root: Path, name: str) -> None:
        # Created under a name the scan and the sweep ignore, locked, then renamed: a sweep
        # never sees it unlocked.
        tmp = root / f".{name}.new"
        self.fd = open_private(tmp, os.O_RDWR, exclusive=True)  # the user's data
        try:
            # Without flock support (rare for a node-local file system) a sweep cannot lock the
            # file either, and leaves it alone.
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.path = root / name
            os.replace(tmp, self.path)
        except BaseException:
            os.close(self.fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def write(self, meta: ShardMeta, buf: torch.Tensor) -> None:
        """Data, then the record (the record is clear: a new file or one cleared by release)."""
        _pwrite_all(self.fd, buf[: meta.nbytes].numpy().data, DATA_OFFSET)
        _pwrite_all(self.fd, encode_record(meta), 0)

    def clear(self) -> None:
        _pwrite_all(self.fd, bytes(RECORD_SIZE), 0)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class ShardFiles:
    """This process's files in one node-local directory, each holding one shard or none.

    Called from the local tier's background thread (write, release, sweep), then close() once
    that thread stopped. Nothing blocks but the file system.
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._prefix = f"shard-{os.getpid()}-{secrets.token_hex(4)}-"
        self._created = 0
        self._held: dict[tuple[int, int], _File] = {}  # (step, owner) -> the file holding it
        self._free: list[_File] = []  # files without a record, to reuse

    def write(self, meta: ShardMeta, buf: torch.Tensor) -> None:
        """Write `meta`'s shard (buf[:meta.nbytes]) into a free file, else a new one. The same
        (step, owner) saved again (training went back) replaces its copy; it is cleared first."""
        f = self._held.pop((meta.step, meta.owner), None)
        if f is not None:
            f.clear()
        elif self._free:
            f = self._free.pop()
        else:
            f = _File(self._root, f"{self._prefix}{self._created}.bin")
            self._created += 1
        try:
            f.write(meta, buf)
        except BaseException:
            self._free.append(f)  # record not written: the file holds nothing
            raise
        self._held[(meta.step, meta.owner)] = f

    def release(self, kept: Callable[[int], bool]) -> None:
        """Clear the files of the steps not `kept` and keep them for reuse (a file that cannot
        be cleared is removed instead)."""
        for key in [k for k in self._held if not kept(k[0])]:
            f = self._held.pop(key)
            try:
                f.clear()
            except OSError:
                _remove(f)
                continue
            self._free.append(f)

    def sweep(self, kept: Callable[[int], bool]) -> int:
        """Remove the files of processes that are gone (nobody holds their lock) whose step is
        not `kept` or that hold no shard; the number removed. Never another live process's."""
        removed = 0
        for entry, fd in _opened(self._root, skip=self._prefix):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its writer is alive
                meta = decode_record(os.pread(fd, RECORD_SIZE, 0))
                if meta is None or not kept(meta.step):
                    os.unlink(entry.path)
                    removed += 1
            except OSError:
                pass
        return removed

    def quarantine(self, after: int, dest: Path) -> list[tuple[int, Path]]:
        """Move out of the directory into ``dest`` (created private) every file holding a step
        newer than ``after``: this process's own (closed, never reused), and those of processes
        that are gone (nobody holds their lock). Their records stay intact (evidence); no scan
        of the directory sees them again. Returns (step, new path) of each. Background thread
        idle (the tier settled first)."""
        moved: list[tuple[int, Path]] = []
        for key in [k for k in self._held if k[0] > after]:
            f = self._held.pop(key)
            moved.append((key[0], _move_into(f.path, dest)))
            os.close(f.fd)
        for entry, fd in _opened(self._root, skip=self._prefix):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its writer is alive
                meta = decode_record(os.pread(fd, RECORD_SIZE, 0))
                if meta is not None and meta.step > after:
                    moved.append((meta.step, _move_into(Path(entry.path), dest)))
            except OSError:
                pass  # alive, or moved meanwhile by a co-located rank
        return moved

    def close(self) -> None:
        """Close every file: the shards stay for a later process, the empty files go."""
        for f in self._free:
            _remove(f)
        for f in self._held.values():
            os.close(f.fd)
        self._free.clear()
        self._held.clear()


def _move_into(path: Path, dest: Path) -> Path:
    private_dir(dest, what="local_dir quarantine directory")
    target = dest / path.name
    os.replace(path, target)
    return target


def _remove(f: _File) -> None:
    with contextlib.suppress(OSError):
        f.path.unlink()
    os.close(f.fd)


def _opened(root: Path, skip: str = "") -> Iterator[tuple[os.DirEntry[str], int]]:
    """Each file of `root` named as a shard file (not starting with `skip`), open read-only
    until the caller moves on; one that vanished or cannot be opened is left out."""
    for entry in os.scandir(root):
        if not _FILE.match(entry.name) or (skip and entry.name.startswith(skip)):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)  # a link is not our shard
        except OSError:
            continue
        try:
            yield entry, fd
        finally:
            os.close(fd)


def scan(root: Path, max_step: int | None = None) -> list[ShardMeta]:
    """Every shard with a record in the directory (unverified: read() checks the checksum), of
    a step up to ``max_step`` (None: any), and not behind a quarantine's fence (``fence``)."""
    out = []
    fences = fence.read(root) if root.is_dir() else []
    for entry, fd in _opened(root) if root.is_dir() else ():
        try:
            meta = decode_record(os.pread(fd, RECORD_SIZE, 0), entry.path)
            written = os.fstat(fd).st_mtime_ns
        except OSError:
            continue
        if meta is None or (max_step is not None and meta.step > max_step):
            continue
        if not fence.distrusted(fences, meta.step, written):
            out.append(meta)
    return out


def read(
    meta: ShardMeta, place: parts.Place | None = None
) -> tuple[torch.Tensor, packing.Parsed] | None:
    """Read the shard a scan found into a new uint8 tensor, with its decoded header; None when
    the file no longer holds it, or it is truncated, not a shard or fails its checksum.

    Reads the header first, then the rest in parts (parts.part_bounds), checksumming each as
    it arrives (the checksum costs about a tenth of the read: see checkpoint.local.integrity).
    `place`: the parts it maps are read straight into the tensors it gives instead of the
    returned buffer.
    """
    n = meta.nbytes
    buf = torch.empty(n, dtype=torch.uint8)
    check = integrity.Checksum()
    try:
        with os.fdopen(os.open(meta.path, os.O_RDONLY | os.O_NOFOLLOW), "rb", buffering=0) as f:
            if decode_record(f.read(RECORD_SIZE)) != meta:
                return None  # rewritten since the scan
            f.seek(DATA_OFFSET)

            def read_into(part: torch.Tensor) -> bool:
                return f.readinto(part.numpy().data) == part.numel()

            end = min(n, packing.PREFIX_SIZE)
            if not read_into(buf[:end]):
                return None
            end = min(n, packing.header_end(bytes(buf[:end].numpy())))
            if not read_into(buf[packing.PREFIX_SIZE : end]):
                return None
            parsed = packing.parse(buf[:end])
            cuts = parts.part_bounds(n, parsed)  # cuts[1] == end: the header is part 0
            dests = place(buf, cuts) if place is not None else {}
            check.update(buf[: cuts[1]])
            for k in range(1, len(cuts) - 1):
                part = dests.get(k, buf[cuts[k] : cuts[k + 1]])
                if not read_into(part):
                    return None  # truncated
                check.update(part)
    except (OSError, CheckpointError):
        return None
    return (buf, parsed) if check.value == meta.checksum else None
