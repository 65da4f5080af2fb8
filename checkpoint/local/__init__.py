"""The local tier: shards in host memory and a node-local directory, replicated to peer nodes."""

from restartable.checkpoint.local.leaf import ReplicatedState
from restartable.checkpoint.local.tier import LocalTier

__all__ = ["LocalTier", "ReplicatedState"]
