"""The persistent tier's integrity module: file CRC32s computed while writing, recorded at commit,
verified on load.

Its counterpart for the local tier is `checkpoint.local.integrity` (xxh3_64 of shards). The
algorithms differ because the costs differ. Here zlib CRC32: every committed manifest records it
(as "crc32"), the standard library computes it, so other tools can check the files, and a load
from storage is bound by reading the files, not by the checksum. The local tier checksums every
copy on its restore path, from memory speed, where xxh3_64 is 7x faster.
"""

from __future__ import annotations

import io
import threading
import zlib
from collections.abc import Mapping
from typing import Any

from restartable.checkpoint.errors import CheckpointAbandoned

_CHUNK = 16 << 20  # read size for verification; large reads keep it I/O bound


class CrcStream(io.RawIOBase):
    """A write-only stream that forwards to ``raw`` and keeps a running CRC32 and size.

    DCP's writer calls ``write``, ``tell``, ``flush``, ``fileno`` (for fsync) and ``close``.
    ``zlib.crc32`` releases the GIL for large buffers, so checksumming costs the training
    thread little while the background writer runs. Once ``cancel`` is set, ``write`` raises
    ``CheckpointAbandoned``: an abandoned save stops within one tensor, not one checkpoint.
    """

    def __init__(self, raw: Any, on_close: Any, *, cancel: threading.Event | None = None) -> None:
        super().__init__()
        self._raw = raw
        self._on_close = on_close
        self._cancel = cancel
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        if self._cancel is not None and self._cancel.is_set():
            raise CheckpointAbandoned("save cancelled while writing")
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        n = self._raw.write(view)
        n = len(view) if n is None else n
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()  # flushes through to the still-open raw stream
        finally:
            self._raw.close()
            self._on_close(self.crc, self.size)


def file_checksum(fs: Any, path: str) -> tuple[int, int]:
    """(crc32, size) of a whole file on an fsspec filesystem."""
    crc = 0
    size = 0
    with fs.open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return crc, size


def verify_files(
    fs: Any, join: Any, files: Mapping[str, Mapping[str, int]], names: list[str]
) -> list[str]:
    """Check ``names`` (a subset of ``files``) against their recorded checksums.

    Returns one human-readable problem per bad file (missing, truncated, checksum mismatch);
    an empty list means every file verified.
    """
    problems = []
    for name in names:
        want = files[name]
        path = join(name)
        try:
            crc, size = file_checksum(fs, path)
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        except OSError as e:
            problems.append(f"{path}: unreadable ({e})")
            continue
        if size != want["size"]:
            problems.append(f"{path}: size {size} bytes, expected {want['size']} (truncated?)")
        elif crc != want["crc32"]:
            problems.append(f"{path}: crc32 {crc:#010x}, expected {want['crc32']:#010x}")
    return problems
