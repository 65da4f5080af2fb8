"""The local tier: shards in host memory and a node-local directory, replicated to peer nodes."""

from checkpoint.local.packing import ReplicatedState
from checkpoint.local.tier import LocalTier

__all__ = ["LocalTier", "ReplicatedState"]
