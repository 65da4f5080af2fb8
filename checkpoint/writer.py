"""DCP storage writers/readers for our step directories, with per-file checksums on write.

We reuse DCP's own ``FileSystemWriter`` / ``FsspecWriter`` (so the on-disk format is exactly
DCP's and plain ``torch.distributed.checkpoint.load`` reads it) and only wrap their
``create_stream`` so each data file's CRC32 and size are recorded as it is written.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Generator
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from checkpoint.integrity import CrcStream
from checkpoint.layout import Layout

DATA_SUFFIX = ".distcp"


class _ChecksummingFs:
    """Proxy of a DCP ``FileSystem`` whose write streams for data files record checksums
    (and stop with ``CheckpointAbandoned`` once ``cancel`` is set)."""

    def __init__(
        self, inner: Any, sink: dict[str, dict[str, int]], cancel: threading.Event | None
    ) -> None:
        self._inner = inner
        self._sink = sink
        self._cancel = cancel
        self._lock = threading.Lock()  # DCP may write files from several threads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        name = os.path.basename(os.fspath(path))
        if "w" not in mode or not name.endswith(DATA_SUFFIX):
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return

        def record(crc: int, size: int) -> None:
            with self._lock:
                self._sink[name] = {"crc32": crc, "size": size}

        with self._inner.create_stream(path, mode) as raw:
            stream = CrcStream(raw, record, cancel=self._cancel)
            try:
                yield stream
            finally:
                stream.close()


def make_writer(
    layout: Layout,
    dirpath: str,
    sink: dict[str, dict[str, int]],
    *,
    thread_count: int,
    cancel: threading.Event | None = None,
) -> StorageWriter:
    """A DCP writer for ``dirpath`` that fills ``sink`` with {file name: {crc32, size}}.

    Setting ``cancel`` makes the next write to a data file raise ``CheckpointAbandoned``.

    Local directories fsync every file (DCP's ``sync_files``). On other fsspec filesystems a
    file is durable when its stream closes (object stores upload on close); asking DCP to fsync
    there would fall back to a global ``os.sync()``, so we do not.
    """
    writer: Any
    if layout.is_local:
        writer = FileSystemWriter(
            dirpath, sync_files=True, thread_count=thread_count, overwrite=False
        )
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(
            layout.url_of(dirpath), sync_files=False, thread_count=thread_count, overwrite=False
        )
    writer.fs = _ChecksummingFs(writer.fs, sink, cancel)
    return writer


def make_reader(layout: Layout, dirpath: str) -> StorageReader:
    """A plain DCP reader for one of our checkpoint directories."""
    if layout.is_local:
        return FileSystemReader(dirpath)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(layout.url_of(dirpath))
