"""The coordination store on an etcd v3 cluster: no single process or host is a point of failure.

``EtcdStore("etcd://h1:2379,h2:2379,h3:2379", prefix="job-42")`` is a
``torch.distributed.Store``; process groups, ``PrefixStore`` and every key of the restart
protocol work over it. Needs the ``etcd`` extra (``pip install 'restartable[etcd]'``). See
docs/etcd.md.
"""

from __future__ import annotations

from inprocess.etcd.errors import EtcdStoreError, EtcdTimeoutError
from inprocess.etcd.store import EtcdStore
from inprocess.etcd.url import EtcdAddress, is_etcd_url, parse_url

__all__ = [
    "EtcdAddress",
    "EtcdStore",
    "EtcdStoreError",
    "EtcdTimeoutError",
    "is_etcd_url",
    "parse_url",
]
