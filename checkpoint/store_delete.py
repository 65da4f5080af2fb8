"""Deleting a key of a store written in Python (``inprocess.etcd.EtcdStore``) from behind torch's
C++ store wrappers: the one convention the writer (``checkpoint.exchange``) and such a backend
share, kept below both. Torch-free at import.

torch's C++ wrappers (the default group's ``PrefixStore``) do not pass ``delete_key`` on to a
store written in Python: "Tried to call pure virtual function ::c10d::Store::deleteKey". They do
pass ``set`` on, so ``delete_key`` here sets the key to ``DELETE_VALUE`` when the real delete
fails, and such a backend deletes a key set to that value (``is_delete``); without it every
exchange key would stay until the job's end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["DELETE_VALUE", "delete_key", "is_delete"]

DELETE_VALUE = b"\x00restartable:delete-key\x00"


def delete_key(store: dist.Store, key: str) -> None:
    """Delete ``key`` from ``store``: its own ``delete_key``, or, where a C++ wrapper cannot
    pass that on (``RuntimeError``), a ``set`` of ``DELETE_VALUE`` that the backend turns into
    the delete. Blocks for one store round trip (two on the fallback)."""
    try:
        store.delete_key(key)
    except RuntimeError:  # a Python store behind a C++ wrapper
        store.set(key, DELETE_VALUE)  # type: ignore[arg-type]  # torch's stub: str; bytes work


def is_delete(value: str | bytes) -> bool:
    """True when a backend written in Python is asked to delete the key it is ``set`` on."""
    return value == DELETE_VALUE
