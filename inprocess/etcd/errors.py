"""The errors of the etcd store backend."""

from __future__ import annotations

import torch.distributed as dist

from restartable.inprocess.errors import InprocessError, StoreTimeoutError


class EtcdStoreError(InprocessError, RuntimeError):
    """The etcd cluster refused a request, or is not an etcd with the v3 API."""


class EtcdTimeoutError(StoreTimeoutError, dist.DistStoreError):
    """A store call did not complete within its bound (no endpoint answered, or a key did not
    appear). Also a ``DistStoreError``, what c10d's own stores raise on a timeout."""
