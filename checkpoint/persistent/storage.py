"""DCP storage writers/readers for our step directories, with per-file checksums on write.

We reuse DCP's own ``FileSystemWriter`` / ``FsspecWriter`` (planning, file naming, metadata, so
plain ``torch.distributed.checkpoint.load`` reads what we write) and wrap their
``create_stream`` so each data file's CRC32 and size are recorded as it is written. The data
files themselves are written by ``write_files``: the same files DCP writes, but each tensor's
``torch.save`` archive is framed from a template so the data goes out without the GIL
(``tensor_bytes``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Generator
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from restartable.checkpoint import _torch_private
from restartable.checkpoint.persistent.integrity import CrcStream
from restartable.checkpoint.persistent.layout import CheckpointDirs
from restartable.checkpoint.persistent.object_bytes import ObjectArchives
from restartable.checkpoint.persistent.safe_reader import SafeFileSystemReader, safe_fsspec_reader
from restartable.checkpoint.persistent.tensor_bytes import ArchiveTemplates
from restartable.checkpoint.private_files import open_private

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
    def _open(self, path: Any, mode: str) -> Generator[Any, None, None]:
        if "w" in mode and isinstance(self._inner, FileSystem):
            # DCP opens with open(): 0644 and through links. Ours: 0600, new, never a link.
            with os.fdopen(open_private(path, os.O_WRONLY, exclusive=True), mode) as stream:
                yield stream
        else:
            with self._inner.create_stream(path, mode) as stream:
                yield stream

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        name = os.path.basename(os.fspath(path))
        if "w" not in mode or not name.endswith(DATA_SUFFIX):
            with self._open(path, mode) as stream:
                yield stream
            return

        def record(crc: int, size: int) -> None:
            with self._lock:
                self._sink[name] = {"crc32": crc, "size": size}

        with self._open(path, mode) as raw:
            stream = CrcStream(raw, record, cancel=self._cancel)
            try:
                yield stream
            finally:
                stream.close()


def make_writer(
    dirs: CheckpointDirs,
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
    if dirs.is_local:
        writer = FileSystemWriter(
            dirpath, sync_files=True, thread_count=thread_count, overwrite=False
        )
    else:
        writer = _torch_private.fsspec_writer_class()(
            dirs.url_of(dirpath), sync_files=False, thread_count=thread_count, overwrite=False
        )
    writer.fs = _ChecksummingFs(writer.fs, sink, cancel)
    return writer


def write_files(
    writer: Any,
    plan: SavePlan,
    planner: DefaultSavePlanner,
    templates: ArchiveTemplates,
    objects: ObjectArchives,
) -> list[WriteResult]:
    """This rank's data files for its final ``plan``: what ``writer.write_data`` writes, file for
    file (same names, same split into ``thread_count`` files, byte items first), fsynced when the
    writer syncs files. Tensors are framed by ``templates``, other values archived by
    ``objects``. Called by the background worker; blocks until every file is closed."""
    buckets = (
        _torch_private.split_write_items(writer.thread_count, plan.items)
        if writer.single_file_per_rank
        else [[item] for item in plan.items]
    )
    # One after the other: the GIL-free data writes leave nothing for more threads to overlap.
    results = []
    for i, items in enumerate(buckets):
        name = f"{plan.storage_data.prefix}{i}{DATA_SUFFIX}"
        results += _write_file(writer, name, items, planner, templates, objects)
    objects.end_save()
    return results


def _write_file(
    writer: Any,
    name: str,
    items: list[Any],
    planner: DefaultSavePlanner,
    templates: ArchiveTemplates,
    objects: ObjectArchives,
) -> list[WriteResult]:
    results = []
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
    ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
    with writer.fs.create_stream(writer.fs.concat_path(writer.path, name), "wb") as stream:
        for item in ordered:
            # DefaultSavePlanner.resolve_data, with the byte items' archives reused
            data = planner.lookup_object(item.index)
            offset = stream.tell()
            if item.type == WriteItemType.BYTE_IO:
                stream.write(objects.archive(data))
            elif isinstance(data, torch.Tensor) and data.device.type == "cpu":
                templates.write(data, stream)
            else:
                raise TypeError(f"{item.index.fqn}: expected a staged CPU tensor")
            length = stream.tell() - offset
            results.append(
                WriteResult(item.index, length, _torch_private.storage_info(name, offset, length))
            )
        if writer.sync_files:
            stream.flush()
            os.fsync(stream.fileno())
    return results


def make_reader(dirs: CheckpointDirs, dirpath: str) -> StorageReader:
    """A DCP reader for one of our checkpoint directories that reads its ``.metadata`` as data
    (``safe_reader``): a crafted file raises ``UnsafeCheckpointError``, it never runs code.
    Load with ``safe_reader.SafeLoadPlanner`` so the small values are read as data too."""
    if dirs.is_local:
        return SafeFileSystemReader(dirpath)
    reader: StorageReader = safe_fsspec_reader(dirs.url_of(dirpath))
    return reader
