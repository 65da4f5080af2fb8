"""Reading a persistent checkpoint as data only: DCP's ``.metadata`` through an allowlisted
unpickler, its small values through ``torch.load(weights_only=True)``.

DCP's own ``FileSystemReader.read_metadata`` calls ``pickle.load`` and its
``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)``: whoever can write a
checkpoint directory (and fix up the unkeyed CRC32s of ``_COMMITTED.json``) could run code in
every rank that loads it. The file format stays DCP's, so plain
``torch.distributed.checkpoint.load`` still reads what we write; only our loaders read it
differently. A refusal raises ``UnsafeCheckpointError`` naming the file and the global.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, metadata
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from restartable.checkpoint import _torch_private
from restartable.checkpoint.errors import CheckpointCorruptError
from restartable.checkpoint.local.header_objects import safe_load, short_reason

# Every global a DCP ``.metadata`` pickle names: DCP's plain dataclasses and one enum,
# torch.Size, dtypes and layouts, the checkpoint id's path. Calling any of them with a pickle's
# arguments builds a value; none of them reaches a file, a module or a process.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", cls.__name__): cls
    for cls in (
        metadata.Metadata,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        metadata.TensorProperties,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
    )
}
_ALLOWED.update(_torch_private.metadata_private_globals())
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("pathlib", "PosixPath")] = pathlib.PosixPath
_ALLOWED[("collections", "OrderedDict")] = collections.OrderedDict
_ALLOWED.update(
    {("torch", n): v for n, v in vars(torch).items() if isinstance(v, (torch.dtype, torch.layout))}
)


class UnsafeCheckpointError(CheckpointCorruptError):
    """A checkpoint file holds something other than plain data; it was refused unread."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals in ``_ALLOWED``."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed") from None


def load_metadata(data: bytes, path: str) -> Metadata:
    """The ``Metadata`` pickled in ``data`` (read from ``path``), built from allowlisted globals
    only, whose data files are plain names inside the checkpoint directory.

    Raises ``UnsafeCheckpointError`` naming ``path`` for anything else; no code of the file runs.
    """
    try:
        found = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise UnsafeCheckpointError(
            f"{path}: not a DCP metadata file of plain data ({short_reason(e)}): refused unread;"
            " delete this checkpoint directory (it was not written by this framework)",
            path=path,
        ) from e
    if not isinstance(found, Metadata):
        raise UnsafeCheckpointError(
            f"{path}: holds a {type(found).__name__}, not DCP Metadata: refused; delete this "
            "checkpoint directory",
            path=path,
        )
    for info in (found.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise UnsafeCheckpointError(
                f"{path}: names data file {name!r} outside its directory: refused; delete this "
                "checkpoint directory",
                path=path,
            )
    return found


class _SafeMetadata:
    """Mixin for DCP's file readers: ``read_metadata`` through ``load_metadata``."""

    fs: Any
    load_id: str

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = _torch_private.metadata_path(self, kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            found = load_metadata(stream.read(), str(path))
        meta = getattr(found, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id  # as DCP's read_metadata does
        found.storage_meta = meta
        return found


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """DCP's ``FileSystemReader`` with the metadata read as data."""


def safe_fsspec_reader(url: str) -> Any:
    """DCP's ``FsspecReader`` for ``url`` with the metadata read as data."""
    base = _torch_private.fsspec_reader_class()
    return type("SafeFsspecReader", (_SafeMetadata, base), {})(url)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` whose byte items (a step counter, hyperparameters, an RNG
    state) load with ``torch.load(weights_only=True)`` and NumPy's RNG types allowlisted."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = safe_load(value.getvalue())
        except Exception as e:
            raise UnsafeCheckpointError(
                f"checkpoint value {fqn!r} is not plain data ({short_reason(e)}): refused "
                "unread; delete this checkpoint directory (it was not written by this framework)"
            ) from e
        # the rest of DefaultLoadPlanner.load_bytes, with the value already loaded
        if self.flatten_state_dict:
            _torch_private.set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
