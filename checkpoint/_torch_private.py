"""Every private torch API the ``checkpoint`` package uses, in one place.

torch does not promise these names across releases. Each accessor here is the only caller of its
private name in the package, and ``tests/unit/test_torch_private.py`` exercises every one, so a
torch upgrade that renames or changes one fails that test loudly instead of failing a save or a
restore at run time. The torch range they were checked on is ``dependencies`` in pyproject.toml.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch


def default_store() -> Any:
    """The store the current default group was created with (our group-creation barrier runs on
    it, so the dedicated group's ranks meet where the default group's did)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def version_counter(tensor: torch.Tensor) -> int:
    """``tensor._version``: how many in-place writes it has had (the overlapped snapshot's check
    that no write raced its copy)."""
    return int(tensor._version)


def is_live_group(group: Any) -> bool:
    """Whether ``group`` is still in torch's registry of process groups (not yet destroyed).

    After ``destroy_process_group()`` of the default group every subgroup is gone from the
    registry, and destroying one again raises.
    """
    import torch.distributed as dist

    return group in dist.distributed_c10d._world.pg_map


def fsspec_writer_class() -> type:
    """DCP's fsspec storage writer (for non-local URLs: ``s3://``, ``memory://`` ...)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter


def fsspec_reader_class() -> type:
    """DCP's fsspec storage reader, the counterpart of ``fsspec_writer_class``."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader


def flatten_state_dict(state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """DCP's flattening of a nested state dict into its fully qualified keys (``a.b.c``)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state)


def save_without_crc(tensor: torch.Tensor, sink: Any) -> None:
    """What ``torch.save(tensor, sink)`` writes with CRC32 off, without changing the
    process-wide option (other threads may be saving)."""
    writer = torch._C.PyTorchFileWriter(sink, False, torch.serialization._get_storage_alignment())
    torch.serialization._save(tensor, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def foreach_copy(
    dsts: list[torch.Tensor] | tuple[torch.Tensor, ...],
    srcs: list[torch.Tensor] | tuple[torch.Tensor, ...],
    *,
    non_blocking: bool,
) -> None:
    """Copy every source into its destination in one dispatch (``torch._foreach_copy_``)."""
    torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def split_write_items(thread_count: int, items: list[Any]) -> list[list[Any]]:
    """DCP's split of a save plan's items into one bucket per writer thread, as its own
    ``FileSystemWriter`` does it (so our writer files the data the same way)."""
    from torch.distributed.checkpoint.filesystem import _split_by_size_and_type

    return _split_by_size_and_type(thread_count, items)


def metadata_private_globals() -> dict[tuple[str, str], Any]:
    """The private globals a DCP ``.metadata`` pickle names, by (module, name): the storage-info
    record, the memory-format enum and the layout lookup."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    return {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    }


def metadata_path(reader: Any, rank: int | None) -> Any:
    """Where DCP's file reader ``reader`` reads its ``.metadata`` (``_get_metadata_path``)."""
    return reader._get_metadata_path(rank)


def set_element(root: Any, path: Any, value: Any) -> None:
    """DCP's placing of one loaded value at its place in a nested state dict (what
    ``DefaultLoadPlanner.load_bytes`` does with a flattened state)."""
    from torch.distributed.checkpoint._traverse import set_element as place

    place(root, path, value)


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's record of where one item's bytes sit in a data file (read back by its readers)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def dtensor_with_local(local: torch.Tensor, like: Any) -> Any:
    """A DTensor with ``like``'s mesh, placements, global shape and stride whose local tensor is
    ``local`` itself, on whatever device ``local`` lives (the DTensor constructor and its
    ``_spec``). ``DTensor.from_local`` would move a host buffer to the mesh's device type, so a
    DTensor of a CUDA mesh staged into host memory would go back onto the GPU."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def dtensor_local_and_spec(dt: Any) -> tuple[torch.Tensor, Any]:
    """A DTensor's own local tensor and its sharding spec, as attributes (``_local_tensor``,
    ``_spec``): two attribute reads where ``to_local()`` costs microseconds, for the local
    tier's per-save check that a DTensor still holds what the last save saw."""
    return dt._local_tensor, dt._spec
