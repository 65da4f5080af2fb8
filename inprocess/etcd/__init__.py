"""The coordination store on an etcd v3 cluster: no single process or host is a point of failure.

``EtcdStore("etcd://h1:2379,h2:2379,h3:2379", prefix="job-42")`` is a
``torch.distributed.Store``; process groups, ``PrefixStore`` and every key of the restart
protocol work over it. Needs the ``etcd`` extra (``pip install 'restartable[etcd]'``). See
docs/etcd.md.

The names below are imported on first use (PEP 562): ``python -m restartable.inprocess.etcd
member|wait`` (an etcd cluster inside a Slurm allocation) and the URL parser start without torch,
whose import takes 3-20 s on a loaded node.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from restartable.inprocess.etcd.url import EtcdAddress, is_etcd_url, parse_url

if TYPE_CHECKING:
    from restartable.inprocess.etcd.errors import EtcdStoreError, EtcdTimeoutError
    from restartable.inprocess.etcd.store import EtcdStore

__all__ = [
    "EtcdAddress",
    "EtcdStore",
    "EtcdStoreError",
    "EtcdTimeoutError",
    "is_etcd_url",
    "parse_url",
]
_LAZY = {
    "EtcdStore": "restartable.inprocess.etcd.store",
    "EtcdStoreError": "restartable.inprocess.etcd.errors",
    "EtcdTimeoutError": "restartable.inprocess.etcd.errors",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'restartable.inprocess.etcd' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
