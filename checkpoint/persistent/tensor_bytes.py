"""Serialize tensors in ``torch.save``'s format without holding the GIL for the data.

DCP stores every tensor as one ``torch.save`` archive inside a data file. ``torch.save`` holds
the GIL while it pickles, builds the zip records and computes their CRC32s: about 0.2 ms per
tensor in a py-spy profile of the writer thread. In a background writer that time is taken from
the training thread, thousands of times per checkpoint.

For a plain contiguous CPU tensor, the archive ``torch.save`` writes with
``torch.serialization.set_crc32_options(False)`` is ``prefix + raw bytes + suffix``, where prefix
and suffix depend only on the dtype, shape and strides. ``ArchiveTemplates`` builds that pair
once per (dtype, shape, strides), by running torch's own serializer with CRC32 off against a
recording stream, and then writes each tensor as three writes; the data write releases the GIL.
``torch.load`` (and so ``torch.distributed.checkpoint.load``) reads the result like any other
``torch.save`` output; the integrity of the data files is covered by our own per-file CRC32.

Anything the template cannot represent exactly (subclasses, views, conjugate bits, tensors that
need grad, an API this torch version lacks) falls back to ``torch.save`` for that tensor.
"""

from __future__ import annotations

import ctypes
import io
import logging
import struct
import threading
import zipfile
from typing import Any

import torch

from restartable.checkpoint import _torch_private

log = logging.getLogger(__name__)

# Writes up to this size are kept as bytes while recording; larger ones are tensor data.
_KEEP_BYTES = 4096
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra field length
_LOCAL_HEADER_SIG = b"PK\x03\x04"

_Key = tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]


class _Recorder(io.RawIOBase):
    """Write sink that keeps small writes and only the size of large ones."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[bytes | int] = []

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b)
        self.chunks.append(bytes(view) if view.nbytes <= _KEEP_BYTES else view.nbytes)
        return view.nbytes


class _Sparse(io.RawIOBase):
    """Read-only, seekable view of a recording: kept bytes, zeros where only a size was kept."""

    def __init__(self, chunks: list[bytes | int]) -> None:
        super().__init__()
        self._starts: list[int] = []
        self._chunks = chunks
        pos = 0
        for c in chunks:
            self._starts.append(pos)
            pos += c if isinstance(c, int) else len(c)
        self.size = pos
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        data = self.slice(self._pos, min(self._pos + len(b), self.size), zeros=True)
        assert data is not None
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def slice(self, start: int, stop: int, *, zeros: bool = False) -> bytes | None:
        """Bytes [start, stop); None if the range covers a size-only chunk (unless ``zeros``)."""
        out = []
        for at, c in zip(self._starts, self._chunks, strict=True):
            size = c if isinstance(c, int) else len(c)
            lo, hi = max(start, at), min(stop, at + size)
            if lo >= hi:
                continue
            if isinstance(c, int):
                if not zeros:
                    return None
                out.append(bytes(hi - lo))
            else:
                out.append(c[lo - at : hi - at])
        return b"".join(out)


def _split(chunks: list[bytes | int], nbytes: int) -> tuple[bytes, bytes] | None:
    """(prefix, suffix) around the data record of a one-tensor archive, or None if the archive
    is not a single stored (uncompressed) data record of ``nbytes``."""
    sparse = _Sparse(chunks)
    with zipfile.ZipFile(sparse) as archive:
        data = [i for i in archive.infolist() if i.filename.endswith("/data/0")]
        if len(data) != 1 or data[0].file_size != nbytes or data[0].compress_type != 0:
            return None
        header = sparse.slice(data[0].header_offset, data[0].header_offset + _LOCAL_HEADER.size)
    if header is None or len(header) != _LOCAL_HEADER.size:
        return None
    sig, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if sig != _LOCAL_HEADER_SIG:
        return None
    data_at = data[0].header_offset + _LOCAL_HEADER.size + name_len + extra_len
    prefix = sparse.slice(0, data_at)
    suffix = sparse.slice(data_at + nbytes, sparse.size)
    if prefix is None or suffix is None:
        return None
    return prefix, suffix


def _templatable(t: torch.Tensor) -> bool:
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
        and t.storage_offset() == 0
        and t.is_contiguous()
        and t.nbytes > 0
        and t.untyped_storage().nbytes() == t.nbytes
        and not t.__dict__
    )


class ArchiveTemplates:
    """Per-(dtype, shape, strides) ``torch.save`` archive framing, built on first use.

    Owned by the persistent saver and used by its writer thread; thread-safe all the same.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._frames: dict[_Key, tuple[bytes, bytes] | None] = {}

    def frame(self, tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
        """(prefix, suffix) such that ``prefix + bytes of tensor + suffix`` is the tensor's
        ``torch.save`` archive (CRC32 off); None when ``tensor`` needs ``torch.save``."""
        if not _templatable(tensor):
            return None
        key = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        with self._lock:
            if key in self._frames:
                return self._frames[key]
        frame = self._build(tensor)
        with self._lock:
            self._frames[key] = frame
        return frame

    def _build(self, tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
        rec = _Recorder()
        try:
            _torch_private.save_without_crc(tensor, rec)
        except Exception as e:  # a torch without these internals: torch.save it is
            log.info("checkpoint: tensor archive templates unavailable (%s); using torch.save", e)
            return None
        try:
            return _split(rec.chunks, tensor.nbytes)
        except (zipfile.BadZipFile, ValueError) as e:
            log.info("checkpoint: unexpected torch.save layout (%s); using torch.save", e)
            return None

    def write(self, tensor: torch.Tensor, stream: Any) -> None:
        """Write ``tensor``'s archive to ``stream``: three writes, the data one without a copy."""
        frame = self.frame(tensor)
        if frame is None:
            torch.save(tensor, stream)
            return
        prefix, suffix = frame
        stream.write(prefix)
        stream.write(raw_bytes(tensor))
        stream.write(suffix)


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor's data (any dtype, bfloat16 included).

    The view does not keep ``tensor`` alive: the caller must, while the view is in use.
    """
    buf = (ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr())
    return memoryview(buf).cast("B")
