"""The local tier: shards in host memory and a node-local directory, replicated to peer nodes."""

from checkpoint.local.leaf import ReplicatedState
from checkpoint.local.tier import LocalTier

__all__ = ["LocalTier", "ReplicatedState"]
